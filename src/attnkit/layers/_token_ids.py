"""Checking token ids before they index an embedding table.

Out-of-range ids fail differently on every backend (torch raises an opaque IndexError, jax clamps
silently, tensorflow raises on CPU only), so the layers check them here, with one message. Values
are checked only when they are concrete (eager); inside a traced or compiled function (jax.jit,
tf.function, symbolic Keras tensors) only the dtype and the static shape can be checked.

Legend: B batch, T sequence length.
"""

import keras
import numpy as np
from keras import ops

from attnkit._validation import ArgumentTypeError
from attnkit.ops.masks import _shape_str


def _concrete_values(x):
    """`x` as a NumPy array when its values exist now, else None (traced or symbolic)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        if isinstance(x, jax.core.Tracer):
            return None
    elif backend == "tensorflow":
        import tensorflow as tf

        if not tf.executing_eagerly() or tf.is_symbolic_tensor(x):
            return None
    elif backend == "torch":
        if x.device.type == "meta":  # Keras traces torch layers on "meta"
            return None
        # keras.ops.convert_to_numpy goes through np.asarray(tensor), which makes NumPy 2 warn
        # (DeprecationWarning: __array__ takes no `copy` keyword) on every call.
        return x.detach().cpu().numpy()
    return np.asarray(ops.convert_to_numpy(x))


def _some(values):
    return np.unique(values.ravel())[:3].tolist()


def check_token_ids(ids, vocab_size, sequence_length, name):
    """Validates a (B, T) batch of token ids and returns it as an integer tensor.

    Args:
        ids: integer array (B, T); a float array is accepted when every value is a whole number
            (it is cast to int32).
        vocab_size: ids must be in [0, vocab_size).
        sequence_length: T must be at most this.
        name: the argument's name, for the messages.

    Returns:
        Integer tensor (B, T).

    Raises:
        ValueError: not rank 2, longer than `sequence_length`, a non-integral float, an id out of
            [0, vocab_size).
        TypeError: neither an integer nor a float dtype.
    """
    ids = ops.convert_to_tensor(ids)
    shape = tuple(ids.shape)
    if len(shape) != 2:
        raise ValueError(
            f"`{name}` must have rank 2, (batch, length), of token ids. Received: {name}.shape={_shape_str(shape)}"
        )
    if shape[1] is not None and shape[1] > sequence_length:
        raise ValueError(
            f"`{name}` must be at most sequence_length={sequence_length} tokens long. "
            f"Received: {name}.shape={_shape_str(shape)}"
        )
    dtype = keras.backend.standardize_dtype(ids.dtype)
    is_float = "float" in dtype
    if not (is_float or "int" in dtype):
        raise ArgumentTypeError(f"`{name}` must hold integer token ids. Received: {name} with dtype={dtype}")
    values = _concrete_values(ids)
    if values is not None:
        if is_float and not np.all(values == np.round(values)):
            raise ValueError(
                f"`{name}` must hold integer token ids; floats are accepted only when they are whole "
                f"numbers. Received: {name} with values such as {_some(values[values != np.round(values)])}"
            )
        out_of_range = (values < 0) | (values >= vocab_size)
        if out_of_range.any():
            raise ValueError(
                f"`{name}` must hold token ids in [0, vocab_size={vocab_size}). "
                f"Received: {name} with values such as {_some(values[out_of_range])}"
            )
    return ops.cast(ids, "int32") if is_float else ids
