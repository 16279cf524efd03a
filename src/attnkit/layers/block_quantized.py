"""`keep_blocks`: a built `Linear` whose kernel is replaced by GGUF blocks kept packed
(docs/decisions.md item 127).

The layer's float kernel variable is dropped (as Keras's own `quantize` drops it) and three
non-trainable variables take its place: `block_values` (uint8 nibbles or int8), `block_scale` and,
for types with a minimum, `block_offset` (float32, one per group). The layer's dtype policy becomes
Keras's "int8_from_<dtype>" or "int4_from_<dtype>" policy, so everything that treats quantized layers
apart (Keras's `__call__` routes them to `quantized_call`; attnkit's side-by-side projections, the
plain torch decoding step and `call_sublayer` leave them to the layer) does so; `Linear.quantized_call`
then runs `attnkit.kernels.quantized.block_linear` on the packed variables.

Legend: N = units (outputs), K inputs.
"""

import keras
import numpy as np

from attnkit.kernels.quantized import BlockWeights


def keep_blocks(dense, weights, activations=None):
    """Replaces built `dense`'s (K, N) kernel by `weights` (`BlockWeights` of shape (N, K)), in place.

    `activations="int8"` quantizes each call's input too (`kernels.quantized.dynamic_int8`; weights
    of `weight_only.quantize_int8`): dynamic int8 products (docs/decisions.md item 141).

    Raises:
        ValueError: `dense` not built, already quantized, with LoRA, or of another shape.
    """
    if not isinstance(weights, BlockWeights):
        raise TypeError(f"`weights` must be BlockWeights. Received: {type(weights).__name__}")
    if not dense.built or dense.quantization_mode is not None or dense.lora_enabled:
        raise ValueError(f"`{dense.name}` must be a built, float Linear without LoRA to keep blocks in it")
    n, k = weights.shape
    check_activations(activations, weights.bits, weights.group, weights.shape, weights.type_name, dense.name, weights.zero, weights.offset)
    if tuple(dense.kernel.shape) != (k, n):
        raise ValueError(
            f"Blocks of shape (N, K)={weights.shape} do not fit `{dense.name}`, whose weight is (N, K)={tuple(dense.kernel.shape)[::-1]}"
        )
    source = dense.dtype_policy.name if dense.dtype_policy.quantization_mode is None else "float32"
    dense._tracker.unlock()
    try:
        # `del dense._kernel` as Keras's `quantize` does, without the gc.collect() Keras's __delattr__
        # runs each time (1 s a layer: 4 minutes for a 135M model's 210 projections)
        dense._untrack_variable(dense._kernel)
        super(keras.layers.Layer, dense).__delattr__("_kernel")
        dense.block_values = _constant(dense, "block_values", weights.values)
        dense.block_scale = _constant(dense, "block_scale", weights.scale)
        dense.block_offset = None if weights.offset is None else _constant(dense, "block_offset", weights.offset)
    finally:
        dense._tracker.lock()
    dense.block_format = dict(bits=weights.bits, zero=weights.zero, group=weights.group, shape=tuple(weights.shape))
    if activations is not None:
        dense.block_format["activations"] = activations
    dense.block_type = weights.type_name
    dense._is_quantized = True  # the policy below must not make Keras quantize the layer again
    dense.dtype_policy = keras.dtype_policies.get(f"{'int4' if weights.bits == 4 else 'int8'}_from_{source}")


def check_activations(activations, bits, group, shape, type_name, name, zero=0, offset=None):
    """Raises a ValueError unless blocks of this layout take `activations` (None, "int8", "q8")."""
    from attnkit.kernels.quantized.block_gemv import q8_takes

    if activations not in (None, "int8", "q8"):
        raise ValueError(f"`activations` must be None, 'int8' or 'q8'. Received: activations={activations!r}")
    if activations == "int8" and (bits != 8 or zero or offset is not None or group != shape[1]):
        raise ValueError(f"int8 activations need per-row int8 weights (`quantize_int8`). Received: {type_name} blocks for `{name}`")
    if activations == "q8" and not q8_takes(bits, group, shape[1]):
        raise ValueError(
            f"q8 activations need 4-bit groups of 32 or 8-bit groups of 16 or of a multiple of 32, with K a multiple of 32. "
            f"Received: {type_name} blocks of group {group} and shape {tuple(shape)} for `{name}`"
        )


def round_activations(model, activations):
    """Sets how every projection of `model` holding blocks treats its input: None (as it is) or "q8"
    (rounded to 8-bit blocks of 32, llama.cpp's arithmetic; docs/decisions.md item 144).

    Raises:
        ValueError: a bad value, no projection holding blocks, or one whose layout cannot take it.
    """
    layers = [layer for layer in model._flatten_layers() if getattr(layer, "block_format", None) is not None]
    if activations not in (None, "q8"):
        raise ValueError(f"`activations` must be None or 'q8'. Received: activations={activations!r}")
    if activations is not None and not layers:
        raise ValueError("`activations='q8'` rounds the inputs of projections holding quantized blocks; this model has none")
    for layer in layers:
        layout = layer.block_format
        check_activations(activations, layout["bits"], layout["group"], layout["shape"], layer.block_type, layer.name)
        if layout.get("activations") == "int8":
            raise ValueError(f"`{layer.name}` holds dynamic int8 products; its activations cannot change")
    for layer in layers:
        layer.block_format.pop("activations", None)
        if activations is not None:
            layer.block_format["activations"] = activations
    if getattr(model, "_torch_decoding_plan", None) is not None:
        model._torch_decoding_plan = None  # its fused blocks read the layouts once


def _constant(layer, name, array):
    array = np.ascontiguousarray(array)
    variable = layer.add_weight(name=name, shape=array.shape, dtype=str(array.dtype), initializer="zeros", trainable=False)
    variable.assign(array)
    return variable


def packed_bytes(model):
    """Bytes of all of `model`'s variables (packed blocks counted as stored)."""
    return sum(int(np.prod(v.shape)) * (2 if v.dtype == "bfloat16" else np.dtype(v.dtype).itemsize) for v in model.variables)
