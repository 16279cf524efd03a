"""Values kept between inference calls on torch (docs/decisions.md items 60 and 71): a mixed-precision
cast, a joined [W_q | W_k | W_v], a kernel's copy in another layout, each made anew when its variables change."""

import weakref

import keras
from keras.src.backend.common.stateless_scope import in_stateless_scope  # no public names in Keras 3
from keras.src.backend.common.variables import get_autocast_scope


# (tag, id of each variable) -> (weak references to the variables, their tensors' (id, version), value).
_KEPT = {}


def kept_value(variables, tag, make):
    """`make()`, a value computed from these Keras variables' tensors, kept between calls on torch.

    Kept while no autograd graph is recorded through them and each variable still holds the same,
    unchanged tensor (`stamp`: an assignment in place, a new tensor, or new data under the same
    tensor each make the value anew). A stateless scope (whose variables stand for other values)
    reads through. Used for what a layer would otherwise recompute from its weights on every call: a
    mixed-precision cast, the side-by-side [W_q | W_k | W_v] (docs/decisions.md item 60). The memory
    is that of the value, for as long as the variables live.
    """
    import torch

    stored = [v._value for v in variables]
    if in_stateless_scope() or not all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in stored):
        return make()  # other values, or traced stand-ins
    if torch.is_grad_enabled() and any(t.requires_grad for t in stored):
        return make()  # the value is part of the graph
    if any(t.is_inference() for t in stored):
        return make()  # made under torch.inference_mode: no version counter tells an assignment
    key = (tag, *map(id, variables))
    entry = _KEPT.get(key)
    if entry is not None and all(ref() is v for ref, v in zip(entry[0], variables)) and current(entry[1], stored):
        return entry[2]
    stamps = [stamp(t) for t in stored]  # before `make`: a write meanwhile makes the value anew next call
    value = _made_outside_inference_mode(make)
    if isinstance(value, torch.Tensor) and all(value is not t for t in stored):
        _KEPT_VALUES[id(value)] = weakref.ref(value, lambda _, i=id(value): _KEPT_VALUES.pop(i, None))
    refs = tuple(weakref.ref(v, lambda _, key=key: _KEPT.pop(key, None)) for v in variables)
    _KEPT[key] = (refs, stamps, value)
    return value


_KEPT_VALUES = {}  # id -> weak reference, of the tensors `kept_value` made (`packable`)


def stamp(t):
    """What identifies a torch tensor's current values: the tensor (weakly), its version counter (an
    in-place change bumps it), and its storage, held so that its address cannot be reused: assigning
    `.data` (as `Module.to` and `vector_to_parameters` do) changes neither the tensor nor its version."""
    return weakref.ref(t), t._version, t.untyped_storage(), t.storage_offset(), t.shape, t.stride()


def current(stamps, tensors):
    """Whether each tensor is the one its stamp was taken of, with the same values."""
    for (ref, version, storage, offset, shape, stride), t in zip(stamps, tensors):
        if ref() is not t or t._version != version or t.untyped_storage()._cdata != storage._cdata:
            return False
        if t.storage_offset() != offset or t.shape != shape or t.stride() != stride:
            return False
    return True


def _made_outside_inference_mode(make):
    """`make()`, as a normal tensor even under torch.inference_mode: a kept inference tensor could not
    be saved for a later backward (frozen weights under autograd)."""
    import torch

    if not torch.is_inference_mode_enabled():
        return make()
    with torch.inference_mode(False), torch.no_grad():
        return make()


def derived(source, tag, make):
    """`make(source)`, a tensor derived from the torch tensor `source` (a kernel's copy in another
    layout), kept between calls; None where it cannot be kept.

    Kept while `source` itself lives with the same values (`stamp`) and no autograd graph runs
    through it: a variable's tensor, a kept mixed-precision cast or a kept [W_q | W_k | W_v] are
    derived once. None for a tensor in a graph, a traced stand-in or an inference tensor (no version
    counter to follow): the caller then computes what it needs per call. The memory is that of the
    derived tensor, for as long as `source` lives (docs/decisions.md items 60 and 71).
    """
    import torch

    if (torch.is_grad_enabled() and source.requires_grad) or type(source) not in (torch.Tensor, torch.nn.Parameter):
        return None  # part of a graph, or a traced stand-in
    if source.is_inference():
        return None  # made under torch.inference_mode: no version counter to follow
    key = (tag, id(source))
    entry = _DERIVED.get(key)
    if entry is not None and current([entry[0]], [source]):
        return entry[1]
    taken = stamp(source)  # before `make`: a write meanwhile makes the value anew next call
    value = _made_outside_inference_mode(lambda: make(source))
    if entry is None or entry[0][0]() is not source:
        weakref.finalize(source, _DERIVED.pop, key, None)  # once per source: gone with it
    _DERIVED[key] = (taken, value)
    return value


_DERIVED = {}  # (tag, id(source)) -> (the source's `stamp`, the derived tensor)


def packable(weight):
    """Whether a packed copy of the torch tensor `weight` may be kept across calls: a value `kept_value`
    keeps (a mixed-precision cast, a joined [W_q | W_k | W_v]), or a half-precision variable's
    tensor (a `torch.nn.Parameter`), whose (d_out, d_in) copy item 60 keeps the same way. Packing
    those adds no case where a kept layout could be stale. A float32 variable's tensor is not packed:
    a write through `param.data` (an EMA update, a hand-written optimizer) bypasses the version
    counter `stamp` follows (decision 71). A tensor made per call (a cast) is not either: it would
    be packed on every call."""
    import torch

    ref = _KEPT_VALUES.get(id(weight))
    if ref is not None and ref() is weight:
        return True
    return type(weight) is torch.nn.Parameter and weight.dtype in (torch.bfloat16, torch.float16)


def variable_value(variable):
    """A Keras variable's value, as `variable.value` reads it; `variable` itself if it is a tensor.

    Inside a mixed-precision layer's call Keras casts a float32 variable to the compute dtype on every
    read: a pass over the weights per call. On torch that cast is kept between calls (`kept_value`), as
    torch's autocast keeps its casts within one context.
    """
    if not isinstance(variable, keras.Variable):
        return variable
    scope = get_autocast_scope()
    if keras.backend.backend() != "torch" or scope is None or scope.dtype is None or not variable._autocast:
        return variable.value
    return kept_value([variable], ("cast", scope.dtype), lambda: variable.value)
