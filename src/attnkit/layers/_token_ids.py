"""Checking token ids before they index an embedding table.

Out-of-range ids fail differently on every backend (torch raises an opaque IndexError, jax clamps
silently, tensorflow raises on CPU only), so the layers check them here, with one message. Values
are checked in NumPy when they are concrete (eager), and inside traced functions (Keras's compiled
`fit`/`predict`/`evaluate`, jax.jit, tf.function) by checks that run in the graph: a host callback
on jax, assertions on tensorflow. Symbolic Keras tensors (building a functional model) have no
values; their dtype and static shape are checked.

Legend: B batch, T sequence length.
"""

import functools

import keras
import numpy as np
from keras import ops

from attnkit._validation import ArgumentTypeError, dtype_name
from attnkit.ops.masks import shape_str


def concrete_values(x):
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


def check_token_ids_dtype(name, ids):
    """Returns the dtype name of `ids` if it is an integer or a float, else raises an ArgumentTypeError.

    Runs before any conversion to a tensor, so that string ids get this message on every backend."""
    dtype = dtype_name(ids)
    if dtype == "bool" or not ("float" in dtype or "int" in dtype):
        raise ArgumentTypeError(f"`{name}` must hold integer token ids. Received: {name} with dtype={dtype}")
    return dtype


def check_values(values, vocab_size, name, is_float):
    """Raises a ValueError unless the NumPy array `values` holds whole numbers in [0, vocab_size)."""
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


def _checked_in_graph(ids, vocab_size, name, is_float, sequence_length=None):
    """`ids`, checked by `check_values` when the traced function runs (jax, tensorflow).

    jax: a `jax.debug.callback` runs `check_values` on the host; its ValueError arrives wrapped in jax's
    `JaxRuntimeError`, message included. tensorflow: `tf.debugging.Assert`s with the same messages, an
    `InvalidArgumentError`. XLA compiles asserts away on tensorflow, so there the layers refuse to be
    compiled (`supports_jit`, and an error when traced under XLA anyway): docs/decisions.md item 20.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        jax.debug.callback(functools.partial(check_values, vocab_size=vocab_size, name=name, is_float=is_float), ids)
        return ids
    if backend != "tensorflow":
        return ids  # torch runs eagerly: its values were concrete, or only traced on "meta"
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(
            f"`{name}`: token ids cannot be checked inside an XLA-compiled tensorflow function "
            "(jit_compile=True), which removes assertions, and unchecked ids give wrong results without an "
            "error. Compile without XLA (Keras's default on tensorflow for attnkit's embedding layers), "
            "or use the jax backend, whose compiled checks run."
        )
    checks = []
    if is_float:
        fractional = tf.not_equal(ids, tf.round(ids))
        checks.append((fractional, f"`{name}` must hold integer token ids; floats are accepted only when they are "
                                    f"whole numbers. Received: {name} with values such as"))
    out_of_range = tf.logical_or(ids < 0, ids >= tf.cast(vocab_size, ids.dtype))
    checks.append((out_of_range, f"`{name}` must hold token ids in [0, vocab_size={vocab_size}). "
                                 f"Received: {name} with values such as"))
    asserts = [
        tf.debugging.Assert(tf.logical_not(tf.reduce_any(bad)), [message, tf.boolean_mask(ids, bad)], summarize=3)
        for bad, message in checks
    ]
    if sequence_length is not None and ids.shape[1] is None:  # a length known only when the graph runs
        length = tf.shape(ids)[1]
        message = f"`{name}` must be at most sequence_length={sequence_length} tokens long. Received: {name} of length"
        asserts.append(tf.debugging.Assert(length <= sequence_length, [message, length]))
    with tf.control_dependencies(asserts):
        return tf.identity(ids)


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
    check_token_ids_dtype(name, ids)
    ids = ops.convert_to_tensor(ids)
    shape = tuple(ids.shape)
    if len(shape) != 2:
        raise ValueError(
            f"`{name}` must have rank 2, (batch, length), of token ids. Received: {name}.shape={shape_str(shape)}"
        )
    if shape[1] is not None and shape[1] > sequence_length:
        raise ValueError(
            f"`{name}` must be at most sequence_length={sequence_length} tokens long. "
            f"Received: {name}.shape={shape_str(shape)}"
        )
    is_float = "float" in keras.backend.standardize_dtype(ids.dtype)
    values = concrete_values(ids)
    if values is not None:
        check_values(values, vocab_size, name, is_float)
    elif not isinstance(ids, keras.KerasTensor):
        ids = _checked_in_graph(ids, vocab_size, name, is_float, sequence_length)
    return ops.cast(ids, "int32") if is_float else ids
