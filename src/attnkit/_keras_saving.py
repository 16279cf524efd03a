"""Keras saves without importing tensorflow on the other backends (docs/decisions.md item 114).

`keras.saving.serialize_keras_object` asks `tf.available and isinstance(obj, tf.TensorShape)` (and
tf.DType, tf.TypeSpec) of every object it serializes; `tf` is Keras's lazy module, and `available`
imports tensorflow to answer. On torch and jax, with tensorflow installed, every `model.save` imported
it: 4 s and absl's log lines on stderr, for a check that cannot succeed, since no object can be a
tensorflow type while tensorflow is not imported. While a save runs, Keras's lazy module answers
"not available" in that case; its answer is put back afterwards.
"""

import contextlib
import sys

import keras


@contextlib.contextmanager
def no_tensorflow_import():
    """Within the block, Keras's serialization does not import tensorflow unless it is already imported
    (or is the backend)."""
    try:
        from keras.src.utils import module_utils
    except ImportError:  # another Keras layout: nothing to do
        yield
        return
    lazy = getattr(module_utils, "tensorflow", None)
    skip = (keras.backend.backend() != "tensorflow" and "tensorflow" not in sys.modules
            and getattr(lazy, "_available", True) is None)
    if not skip:
        yield
        return
    lazy._available = False
    try:
        yield
    finally:
        lazy._available = None  # unasked, as before: a later use of tensorflow's data pipelines still works


def save_model(model, path):
    """`model.save(path)` without importing tensorflow where it is not in use."""
    with no_tensorflow_import():
        model.save(path)
