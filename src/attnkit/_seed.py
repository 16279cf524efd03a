"""Seeding a training run: `keras.utils.set_random_seed`, without importing tensorflow under another
backend (docs/decisions.md items 87 and 98)."""

import random
import sys

import keras
import numpy as np
from keras.src.backend.common import global_state
from keras.src.random import seed_generator
from keras.src.utils import rng_utils


def set_random_seed(seed):
    """Seeds Python's `random`, NumPy, the backend and Keras's global seed generator, as
    `keras.utils.set_random_seed` does.

    Keras also seeds tensorflow whenever it is installed, for `tf.data` pipelines, and so imports it
    (several seconds, and absl's log lines on stderr) under torch and jax too. attnkit feeds `fit`
    NumPy arrays, so tensorflow is seeded only where it is the backend or was already imported: there
    Keras's own function runs; elsewhere its steps but the tensorflow one, through Keras's global
    state functions (rather than switching Keras's lazy tensorflow module off and on again, an
    attribute of another library's object; item 98). tests/test_seed.py holds the draws equal.
    """
    if keras.backend.backend() == "tensorflow" or "tensorflow" in sys.modules:
        keras.utils.set_random_seed(seed)
        return
    if not isinstance(seed, int):  # Keras's own check and message
        raise ValueError(f"Expected `seed` argument to be an integer. Received: seed={seed} (of type {type(seed)})")
    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)  # re-made from the seed
    random.seed(seed)
    np.random.seed(seed)
    if keras.backend.backend() == "torch":
        import torch

        torch.manual_seed(seed)
