"""Argument checks shared by every layer and op: one message format everywhere.

Messages follow "`name` must be ... Received: name=value" so tests (and users) can match them.
"""

import math
import numbers

import keras
import numpy as np


class ArgumentTypeError(TypeError, ValueError):
    """A wrong type for an argument. Both a `TypeError` and a `ValueError`, so either `except` catches it."""


def positive_int(name, value):
    """Returns `value` as an int, or raises if it is not a positive integer (bools refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    if value <= 0:
        raise ValueError(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


def optional_positive_int(name, value):
    """Returns None for None, else `positive_int(name, value)` (an optional size, such as a window)."""
    return None if value is None else positive_int(name, value)


def rate(name, value):
    """Returns `value` as a float in [0, 1), the range of a dropout rate."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"`{name}` must be a float in [0, 1). Received: {name}={value!r}")
    if not (0.0 <= float(value) < 1.0):
        raise ValueError(f"`{name}` must be a float in [0, 1). Received: {name}={value!r}")
    return float(value)


def positive_float(name, value):
    """Returns `value` as a float that is finite and > 0 (a softmax scale, an epsilon)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"`{name}` must be a finite positive number. Received: {name}={value!r}")
    if not math.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"`{name}` must be a finite positive number. Received: {name}={value!r}")
    return float(value)


def boolean(name, value):
    """Returns `value` as a bool (None stays None); True, False, NumPy bools and the integers 0 and 1 pass.

    Anything else, such as "yes" (truthy) or 2, is refused rather than read by its truthiness.
    """
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or (
        isinstance(value, numbers.Integral) and not isinstance(value, bool) and value in (0, 1)
    ):
        return bool(value)
    raise ArgumentTypeError(f"`{name}` must be a bool. Received: {name}={value!r}")


def dtype_name(x):
    """The standardized dtype name of a tensor, KerasTensor, array or nested list, without converting it
    to a backend tensor (which fails on strings with a backend's own message): 'float32', 'int64',
    'bool', 'string', ..."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        dtype = np.asarray(x).dtype
    if isinstance(dtype, np.dtype) and dtype.kind in "USO":
        return "string" if dtype.kind in "US" else "object"
    try:
        return keras.backend.standardize_dtype(dtype)
    except ValueError:
        return getattr(dtype, "name", str(dtype))  # e.g. tensorflow's "string"


def floating(name, x):
    """Raises an ArgumentTypeError unless `x` (tensor or array) has a floating-point dtype; returns its dtype.

    Integer, bool and string inputs reach a softmax or a projection on none of the backends the same way
    (all-zero weights on jax, kernel errors on torch and tensorflow): they are refused here, alike."""
    dtype = dtype_name(x)
    if "float" not in dtype:
        raise ArgumentTypeError(f"`{name}` must be a floating-point tensor. Received: {name} with dtype={dtype}")
    return dtype
