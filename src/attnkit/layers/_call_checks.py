"""`CheckedCall`: the checks of a layer call's arguments that must run before Keras's `Layer.__call__`.

`Layer.__call__` converts every array argument to a backend tensor first, and a string array fails
there with each backend's own message ("Invalid dtype: str32" on torch, "could not convert string to
float" on jax). The layers list their arguments by kind, and these checks give one `TypeError` naming
the argument and its dtype on every backend (docs/decisions.md item 19). Their `call`s check again
what only a tensor shows (shapes, values).
"""

import functools
import inspect

import numpy as np

from attnkit._validation import boolean, floating, positive_int
from attnkit.layers._token_ids import check_token_ids_dtype
from attnkit.ops.masks import check_mask_dtype


class CheckedCall:
    """A mixin, before `keras.layers.Layer` in the bases: checks the call arguments named in
    `_call_checks`, a dict with any of the keys "floats" (floating tensors), "ids" (token ids,
    integers or floats), "masks" (boolean or integer keep-masks), "flags" (bools) and "ints" (sizes
    given to `call`, such as the seeds' `d_k`), each a tuple of `call`'s argument names. Flags and
    NumPy integer scalars reach `call` as Python bools and ints.

    It is also the one place where a layer accepts the seeds' positional arguments (docs/decisions.md
    item 46): with `_positional_training`, a `training` passed as the last positional argument is
    handed to Keras as a keyword (Keras resolves it only as one); with `_non_tensor_positionals`,
    Keras lets positional arguments that are not tensors through (the seeds' `d_k`, Python masks).
    """

    _call_checks = {}
    _positional_training = False
    _non_tensor_positionals = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self._non_tensor_positionals:
            self._allow_non_tensor_positional_args = True  # Keras's own switch, set here alone

    def __call__(self, *args, **kwargs):
        if self._positional_training and "training" not in kwargs and len(args) == _training_slot(type(self)):
            *args, kwargs["training"] = args
        arguments = _bound(type(self), args, kwargs)
        if arguments is not None:
            check_arguments(arguments, **self._call_checks)
            args, kwargs = _as_python(type(self), args, kwargs, arguments, self._call_checks)
        return super().__call__(*args, **kwargs)


def check_arguments(arguments, floats=(), ids=(), masks=(), flags=(), ints=()):
    """Checks the named entries of `arguments` (name -> value); None values pass."""
    checks = ((floating, floats), (check_token_ids_dtype, ids), (_mask, masks), (boolean, flags), (positive_int, ints))
    for check, names in checks:
        for name in names:
            value = arguments.get(name)
            if isinstance(value, (tuple, list)) and value and hasattr(value[0], "shape"):
                for part in value:  # a pair of tensors in one argument, as `fit` passes a model's inputs
                    check(name, part)
            elif value is not None:
                check(name, value)


def _as_python(cls, args, kwargs, arguments, checks):
    """`args` and `kwargs` with the flags as Python bools and NumPy integer scalars among "ints" (the
    seeds' `d_k`) as Python ints: Keras would turn NumPy scalars into tensors, which `call` cannot read
    as a flag or a size."""
    plain = {name: boolean(name, arguments[name]) for name in checks.get("flags", ()) if arguments.get(name) is not None}
    plain.update({name: int(arguments[name]) for name in checks.get("ints", ()) if isinstance(arguments.get(name), np.integer)})
    if not plain:
        return args, kwargs
    names = list(_signature(cls).parameters)[1:]  # without `self`
    args = [plain.get(names[i], value) if i < len(names) else value for i, value in enumerate(args)]
    return args, {name: plain.get(name, value) for name, value in kwargs.items()}


def _mask(name, value):
    check_mask_dtype(value, name)


def _bound(cls, args, kwargs):
    """`call`'s arguments by name, or None when they do not bind (Keras's own error then follows)."""
    try:
        return _signature(cls).bind_partial(None, *args, **kwargs).arguments  # None: `self`
    except TypeError:
        return None


@functools.cache
def _signature(cls):
    return inspect.signature(cls.call)


@functools.cache
def _training_slot(cls):
    """How many positional arguments `call` takes up to and including `training` (None without one)."""
    names = list(_signature(cls).parameters)[1:]  # without `self`
    return names.index("training") + 1 if "training" in names else None
