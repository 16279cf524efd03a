"""`call_sublayer`: the one way a layer calls the layers it owns inside its `call` (docs/decisions.md
item 45).

The convention: inside a layer's `call` (and its public methods that run the same stack, such as
`Encoder.encode` and decoding), every owned, built layer is called as `call_sublayer(layer, *tensors,
**keywords)`, with `training` and every mask passed explicitly by keyword, the Keras masks that
`__call__` would fill included (e.g. a cross-attention's `keys_mask`). The embedding layers are the
exception: they are called through `__call__`, since the Keras mask they attach to their output is
the padding mask that the caller (and Keras's own mask propagation) reads.

Why: Keras's `Layer.__call__` binds the arguments to the signature, checks the input specs, opens name
and autocast scopes, resolves `training` and masks, and records mask metadata on the outputs: on the
torch backend, eagerly, many times the GEMM of a small `Linear` (docs/performance.md, "Measurements
behind the code"); a 6-layer encoder makes some 60 such calls. Inside the parent's `call` that work
is already done: the parent's `__call__` cast the inputs to the compute dtype and opened the autocast
scope that also covers the sublayers' variables (they share the parent's dtype policy), the parent
passes `training` and masks explicitly, and no one reads the mask metadata of intermediate results.
Where any of that does not hold, `call_sublayer` goes through `__call__` itself (see below), so
symbolic tracing, mixed precision, quantization and distribution stay Keras's. jax and tensorflow
compile the forward pass, so for them this only shortens tracing.
"""

import contextlib
import functools

import keras
from keras.src.backend.common.variables import AutocastScope, get_autocast_scope  # no public names in Keras 3

from attnkit.layers._policies import own_policy
from attnkit import kernels


def call_sublayer(layer, *args, **kwargs):
    """`layer(*args, **kwargs)`, skipping `Layer.__call__` where it would change nothing.

    `layer.call` runs directly only when `layer` is built, not quantized (Keras routes those to
    `quantized_call`), not rematerialized, not under a `keras.distribution` (it may lay out outputs by
    layer path), of one dtype for variables and compute or inside the autocast scope its own
    `__call__` would open (a mixed-precision parent's: its variables are then cast the same way), and
    every positional argument is already a backend tensor (or None), of its compute dtype if floating.
    Otherwise Keras's own `__call__` runs. Keyword arguments are passed as they are: give `training`
    and masks explicitly.

    Args:
        layer: a sublayer of the calling layer.
        *args, **kwargs: the call's arguments.

    Returns:
        What `layer(*args, **kwargs)` returns.
    """
    if _keras_call_needed(layer, args):
        return layer(*args, **kwargs)
    return layer.call(*args, **kwargs)


def _keras_call_needed(layer, args, reads_cast_variables=True):
    """Whether `layer(*args)` would do more than `layer.call(*args)`. `reads_cast_variables=False` says
    that the layer's call reads no variable autocast would cast (a norm layer's float32 gamma and beta)."""
    policy = own_policy(layer)  # its entry in a policy map (a reloaded quantized model's), by its path
    if (
        not layer.built
        or policy.quantization_mode is not None
        or getattr(layer, "_remat_mode", None) is not None
        or keras.distribution.distribution() is not None
    ):
        return True
    if reads_cast_variables and _scope_its_call_opens(layer)[0]:
        return True  # its variables must be read in the autocast scope its __call__ opens
    for arg in args:
        if arg is None:
            continue
        if not keras.ops.is_tensor(arg):
            return True  # Keras converts arrays and Python numbers
        dtype = _dtype_name(arg.dtype)
        if "float" in dtype and dtype != policy.compute_dtype:
            return True  # Keras casts floating inputs to the compute dtype
    return False


def _scope_its_call_opens(layer):
    """(opens, dtype): whether `layer.__call__` would run its call in another autocast scope than the
    one open now, and that scope's dtype, by Keras's rule (`Layer.__call__`, step 7). Where no scope
    is open, a mixed policy opens one of its compute dtype; inside another layer's scope, a layer
    opens one of its own compute dtype (None, no casts, if it does not autocast or computes in no
    floating dtype). So a float32 sublayer inside a mixed-precision parent's scope reads its kernels
    in float32, as its `__call__` would, not cast to the parent's bfloat16."""
    scope = get_autocast_scope()
    if scope is None:
        mixed = layer.compute_dtype != layer.variable_dtype
        return mixed, (layer.compute_dtype if mixed else None)
    dtype = layer.compute_dtype if layer.autocast and "float" in _dtype_name(layer.compute_dtype) else None
    return scope.dtype != dtype, dtype


_DTYPE_NAMES = {}


def _dtype_name(dtype):
    """keras.backend.standardize_dtype(dtype), remembered: a dict look-up instead of a parse per argument."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = keras.backend.standardize_dtype(dtype)
    return name


def call_layer_stack(layers, x, padding_mask, training, return_attention_weights):
    """x (B, T, d_model) through the encoder layers `layers` in turn (`call_sublayer`), each given the
    keep-mask `padding_mask`. Returns x, or (x, their n weight arrays (B, h, T, T)) when asked."""
    weights = []
    for layer in layers:
        if return_attention_weights:
            x, layer_weights = call_sublayer(layer, x, padding_mask, training=training, return_attention_weights=True)
            weights.append(layer_weights)  # (B, h, T, T)
        else:
            x = call_sublayer(layer, x, padding_mask, training=training)  # (B, T, d_model)
    return (x, weights) if return_attention_weights else x


def in_own_scope(method):
    """Decorates a public method of a layer that runs its sublayers or reads its variables itself,
    outside `__call__` (`MultiHeadAttention.project_queries`, `Transformer.logits`, a decoding step):
    it runs in the autocast scope the layer's `__call__` would open (`_scope_its_call_opens`), so a
    float32 layer's kernels are read in float32 inside a mixed-precision caller's scope, and a mixed
    layer's in its compute dtype outside any. Inside the layer's own call nothing changes."""

    @functools.wraps(method)
    def scoped(layer, *args, **kwargs):
        opens, dtype = _scope_its_call_opens(layer)
        if not opens:
            return method(layer, *args, **kwargs)
        with AutocastScope(dtype):
            return method(layer, *args, **kwargs)

    return scoped


@contextlib.contextmanager
def as_in_own_call(layer, x):
    """For a public method of `layer` that runs its sublayers itself (`Encoder.encode`): yields `x`
    converted as `layer.__call__` converts its inputs (`DTypePolicy.convert_input`), inside the
    autocast scope `__call__` would open (`_scope_its_call_opens`: a mixed policy's compute dtype where
    no scope is open; the layer's own compute dtype inside another's scope).
    There `call_sublayer` skips the sublayers' own `__call__`s, as it does inside `layer.__call__`.
    An `x` that is not floating is yielded as it is, with no scope: the sublayers' `__call__`s then
    check it and refuse it with their own errors."""
    if isinstance(x, (list, tuple)):  # nested Python numbers, as Keras's `__call__` converts them
        x = keras.ops.convert_to_tensor(x)
    dtype = getattr(x, "dtype", None)
    if dtype is None or "float" not in keras.backend.standardize_dtype(dtype):
        yield x
        return
    x = layer.dtype_policy.convert_input(x, layer.autocast, layer.input_dtype)
    opens, dtype = _scope_its_call_opens(layer)
    if opens:
        with AutocastScope(dtype):
            yield x
    else:
        yield x


def call_layer_norm(norm, x):
    """`call_sublayer(norm, x)` for a norm layer; one fused call for a `keras.layers.LayerNormalization`
    over the last axis.

    On torch that is one `torch.nn.functional.layer_norm` (the call Keras's layer makes there, so the
    same numbers), made directly where `call_sublayer` would skip `__call__` anyway; on tensorflow,
    inside a `tf.function`, Keras's formula compiled as one XLA function (`kernels.tensorflow_layer_norm`).
    """
    if (
        isinstance(norm, keras.layers.LayerNormalization)
        and norm.built
        and not norm.rms_scaling
        and norm.axis in ([-1], [len(x.shape) - 1])
        and not _keras_call_needed(norm, (x,), reads_cast_variables=False)
    ):
        y = kernels.layer_norm(x, norm.gamma if norm.scale else None, norm.beta if norm.center else None, norm.epsilon)
        if y is not None:
            return y
    return call_sublayer(norm, x)
