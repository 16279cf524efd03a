"""Argument checks shared by every layer and op: one message format everywhere.

Messages follow "`name` must be ... Received: name=value" so tests (and users) can match them.
"""

import math
import numbers


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
    if not isinstance(value, (bool, type(None))) and not (
        isinstance(value, numbers.Integral) and value in (0, 1)
    ):
        raise ArgumentTypeError(f"`{name}` must be a bool. Received: {name}={value!r}")
    return value
