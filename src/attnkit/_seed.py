"""Seeding a training run: `keras.utils.set_random_seed`, without importing tensorflow under another
backend (docs/decisions.md item 87)."""

import sys

import keras


def set_random_seed(seed):
    """Seeds Python's `random`, NumPy, the backend and Keras's global seed generator, as
    `keras.utils.set_random_seed` does.

    Keras also seeds tensorflow whenever it is installed, for `tf.data` pipelines, and so imports it
    (several seconds, and absl's log lines on stderr) under torch and jax too. attnkit feeds `fit`
    NumPy arrays, so tensorflow is seeded only where it is the backend or was already imported.
    """
    from keras.src.utils import rng_utils

    lazy_tf = getattr(rng_utils, "tf", None)
    skip_tf = (keras.backend.backend() != "tensorflow" and "tensorflow" not in sys.modules
               and getattr(lazy_tf, "_available", "missing") is None)  # Keras's LazyModule, not yet imported
    if not skip_tf:
        keras.utils.set_random_seed(seed)
        return
    lazy_tf._available = False
    try:
        keras.utils.set_random_seed(seed)
    finally:
        lazy_tf._available = None
