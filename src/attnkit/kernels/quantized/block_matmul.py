"""x W^T + b with W held as `BlockWeights` (integer values, per-group scales and offsets), dequantized
inside the product (docs/decisions.md item 126).

    W[n, g*group + i] = scale[n, g] * (q[n, g*group + i] - zero) + offset[n, g]
    y = x W^T + b

On torch's CPU, a float32 x of at most `block_gemv.MAX_ROWS` rows (a decoding step) goes to
`block_gemv`, which reads the packed bytes once and dequantizes in registers (item 136). Otherwise
every backend runs the same two steps, dequantize then one float GEMM: on jax and tensorflow a
compiled call (`CausalLM._compiled_call`) gives XLA / Grappler both as one program, which fuses the
dequantization into the product's operand; on torch, eagerly, the dequantized W is a temporary of
the call (the model keeps only the packed values). torch's own weight-only kernels were measured and
not used: on this project's CPU (AVX2, no AVX-512) `_weight_int4pack_mm_for_cpu` took 15x and
`_weight_int8pack_mm` 7x a float32 `linear` of the same shape at batch 1, and the int8 one rounds
the activations (errors of 2e-3 where float32 gives 1e-6).

Exactness: W is gguf's float32 dequantization bit for bit (the integer values are exact in float32,
and scale and offset are applied in gguf's order); y differs from a float64 x W^T only by float32
accumulation, |y - y_64| <= 1e-5 * (|x| |W|^T) + 1e-6 (tests/kernels/test_quantized_blocks.py).
`block_gemv` sums s_g * sum q x + (offset_g - s_g zero) * sum x per group g: its bound is
1e-5 * sum_g (|s_g| sum |q x| + |offset_g - s_g zero| sum |x|) + 1e-6, the same as the first where
a group's weights are not small beside its offset (llama.cpp's quantizer makes a group's minimum one
of its weights), larger where the two sums cancel: weights of -0.1875 stored as 15 x 66.69 - 1000.5
lost 1e-3 of a product of 256 normal inputs (tests/kernels/test_block_gemv.py). In
bfloat16 the dequantized W is rounded to bfloat16 once, then multiplied in float32: the bound is
that of bfloat16 weights, 2^-8 relative.

Legend: N outputs, K inputs, G = K / group groups, B... leading axes of x.
"""

import keras
from keras import ops

from attnkit.kernels.quantized import block_gemv, dynamic_int8


def dequantize(values, scale, offset, *, bits, zero, group, shape, activations=None, dtype="float32"):
    """W (N, K) in `dtype` from packed tensors (see `BlockWeights`; any backend's tensors).

    Args:
        values: uint8 (N, K / 2) when bits == 4, else int8 (N, K).
        scale: float32 or float16 (N, G) (GGUF's own Q4_0 / Q4_1 / Q8_0 scales), widened exactly.
        offset: (N, G) in scale's dtype, or None.
        bits, zero, group, shape: as in `BlockWeights`.
        activations: how a product treats x (see `block_linear`); W does not depend on it.
        dtype: the result's dtype (the float32 dequantization, rounded once).
    """
    n, k = shape
    scales = (scale,) if offset is None else (scale, offset)
    if _torch_cpu(values, scales=scales):  # one pass in C, the same numbers (a prefill's GEMM operand)
        w = block_gemv.dequantize(values, scale, offset, bits=bits, zero=zero, group=group, shape=shape)
        return w if dtype == "float32" else ops.cast(w, dtype)
    if bits == 4:
        v = ops.reshape(values, (n, k // 32, 16))  # (N, G, 16): element i low, i + 16 high
        q = ops.concatenate([ops.bitwise_and(v, 15), ops.right_shift(v, 4)], axis=-1)  # (N, G, 32) uint8
    else:
        q = ops.reshape(values, (n, k // group, group))  # (N, G, group) int8
    q = ops.cast(q, "float32")  # small integers: exact
    if zero:
        q = ops.subtract(q, float(zero))
    w = ops.multiply(ops.expand_dims(ops.cast(scale, "float32"), -1), q)  # (N, G, group); a float16 scale widened exactly
    if offset is not None:
        w = ops.add(w, ops.expand_dims(ops.cast(offset, "float32"), -1))
    w = ops.reshape(w, (n, k))
    return w if dtype == "float32" else ops.cast(w, dtype)


def block_linear(x, values, scale, offset, bias=None, *, bits, zero, group, shape, activations=None):
    """x (..., K) W^T + bias (N,) -> (..., N) in x's dtype, W dequantized inside the call.

    float32 x: float32 products. bfloat16 x: W rounded to bfloat16 (the weights a bfloat16 model
    holds), the products accumulated in float32 by the backend's own bfloat16 GEMM.
    activations="int8" (weights of `weight_only.quantize_int8`): x is quantized too, per call
    (`dynamic_int8`, docs/decisions.md item 141); its result is float32. activations="q8": x rounded
    to 8-bit blocks of 32 as llama.cpp rounds it (`round_q8`, item 144), then multiplied: integer dot
    products in `block_gemv` for a few rows on torch's CPU, the float product of x^ elsewhere."""
    if activations == "int8":
        if bits != 8 or zero or offset is not None or group != shape[1]:
            raise ValueError(f"int8 activations need per-row int8 weights (group = K, no offset). Received: bits={bits}, group={group}, shape={shape}")
        return dynamic_int8.linear(x, values, scale, bias)
    if activations not in (None, "q8"):
        raise ValueError(f"`activations` must be None, 'int8' or 'q8'. Received: activations={activations!r}")
    if activations == "q8" and not block_gemv.q8_takes(bits, group, shape[1]):
        raise ValueError(f"q8 activations need 4-bit groups of 32 or 8-bit groups of 16 or of a multiple of 32, K a multiple of 32. Received: bits={bits}, group={group}, shape={shape}")
    dtype = ops.dtype(x) if hasattr(x, "dtype") else "float32"
    dtype = dtype if dtype in ("float32", "bfloat16", "float16") else "float32"
    if _few_rows_on_cpu(x, values, scale, offset, dtype):
        # a decoding step's product: the packed bytes read once, dequantized in registers (block_gemv)
        k = shape[1]
        y = block_gemv.block_gemv(
            x.reshape(-1, k), values, scale, offset, bits=bits, zero=zero, group=group, shape=shape, activations=activations
        )
        if y is not None:  # None: an infinity in x, which the kernel's factored sums would turn into NaN
            y = y.reshape(*x.shape[:-1], shape[0])  # (..., N)
            return y if bias is None else y + bias
    custom = _custom_op_for(x, values, scale, offset, bits, dtype)
    if custom is not None:
        # the same kernel as jax's custom call or tensorflow's op, inside the compiled step (decision 162)
        layout = (bits, float(zero), group, tuple(shape), activations)
        y = custom.product(layout, ops.reshape(x, (-1, shape[1])), values, scale, offset)
        y = ops.reshape(y, (*x.shape[:-1], shape[0]))  # (..., N)
        return y if bias is None else ops.add(y, ops.cast(bias, dtype))
    if activations == "q8":
        x = ops.cast(round_q8(x), dtype)  # x^: the same rounding as block_gemv_q8.c, then the float product
    w = dequantize(values, scale, offset, bits=bits, zero=zero, group=group, shape=shape, dtype=dtype)  # (N, K)
    if keras.backend.backend() == "torch" and ops.is_tensor(x):
        import torch

        # one GEMM with the bias added inside it, on W's transposed view (no copy)
        b = None if bias is None else bias.to(w.dtype)
        return torch.nn.functional.linear(x.to(w.dtype), w, b)
    y = ops.matmul(ops.cast(x, dtype), ops.transpose(w))  # (..., N)
    return y if bias is None else ops.add(y, ops.cast(bias, dtype))


def dequantized_product(layout, x, values, scale, offset):
    """x (M, K) float32 times the dequantized W^T -> (M, N) float32, x rounded first for q8 activations:
    the product jax's and tensorflow's kernels stand for (their path where the kernel declines, and
    the function their gradient differentiates). layout: (bits, zero, group, shape, activations)."""
    bits, zero, group, shape, activations = layout
    x = round_q8(x) if activations == "q8" else x
    return ops.matmul(x, ops.transpose(dequantize(values, scale, offset, bits=bits, zero=zero, group=group, shape=shape)))


def round_q8(x):
    """x (..., K), K a multiple of 32 -> x^ (..., K) float32: each block of 32 of a row rounded as
    llama.cpp's Q8_0 rounds it (block_gemv_q8.c; docs/decisions.md item 144),
    d = float16(max|x_b| / 127), x^_i = d round_half_even(x_i 127 / max|x_b|); a row with a block
    that cannot be rounded (an infinity or NaN, or d beyond float16) stays unrounded. No gradient
    flows through the rounding (inference only)."""
    x = ops.cast(x, "float32")
    if 0 in tuple(x.shape):
        return x  # no rows: nothing to round (the reductions below refuse empty tensors)
    shape = ops.shape(x)
    k = shape[-1]
    if _torch_cpu(x) and not (x.requires_grad and _grad_enabled()):
        return block_gemv.round_q8(x.reshape(-1, k)).reshape(shape)  # the kernel's own rounding, in one pass
    blocks = ops.reshape(x, (-1, k // 32, 32))  # (rows, K / 32, 32)
    top = ops.max(ops.abs(blocks), axis=-1, keepdims=True)  # (rows, K / 32, 1)
    d = ops.cast(ops.cast(ops.divide(top, 127.0), "float16"), "float32")
    positive = ops.greater(top, 0.0)
    inverse = ops.where(positive, ops.divide(127.0, ops.where(positive, top, 1.0)), 0.0)
    rounded = ops.multiply(ops.round(ops.multiply(blocks, inverse)), d)
    fine = ops.logical_and(ops.all(ops.isfinite(blocks), axis=(1, 2)), ops.all(ops.isfinite(d), axis=(1, 2)))  # (rows,)
    return ops.reshape(ops.where(ops.reshape(fine, (-1, 1, 1)), rounded, blocks), shape)


def _torch_cpu(*tensors, scales=()):
    """Whether the tensors are torch CPU tensors, the float ones float32 (`scales`: float32, or float16
    all of them), and the C kernels built."""
    if keras.backend.backend() != "torch" or not all(ops.is_tensor(t) for t in (*tensors, *scales)):
        return False
    import torch

    return (
        all(t.device.type == "cpu" and (t.dtype == torch.float32 or not t.is_floating_point()) for t in tensors)
        and all(t.device.type == "cpu" for t in scales) and (not scales or block_gemv.takes_scales(*scales))
        and block_gemv.available()
    )


def _grad_enabled():
    import torch

    return torch.is_grad_enabled()


def _few_rows_on_cpu(x, values, scale, offset, dtype):
    """Whether x W^T goes to `block_gemv`: torch, float32, CPU tensors, at most MAX_ROWS rows of x, outside
    autograd (the kernel has no gradient), and the kernel built."""
    if keras.backend.backend() != "torch" or dtype != "float32" or not ops.is_tensor(x):
        return False
    import torch

    if x.dtype != torch.float32 or not block_gemv.takes_scales(scale, offset):  # float64 / integer x: the GEMM path casts them
        return False
    if x.device.type != "cpu" or values.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return False
    rows = x.numel() // x.shape[-1] if x.ndim else 0
    return 0 < rows <= block_gemv.MAX_ROWS and block_gemv.available()


def _custom_op_for(x, values, scale, offset, bits, dtype):
    """The module whose `product` runs x W^T in block_gemv's kernel on jax or tensorflow (jax_block_gemv,
    tf_block_gemv), or None: a CPU, float32 x of at most MAX_ROWS rows (static shapes), the values and
    scales the kernel reads, and the op built."""
    backend = keras.backend.backend()
    if backend not in ("jax", "tensorflow") or dtype != "float32" or not hasattr(x, "shape") or not x.shape:
        return None
    standard = keras.backend.standardize_dtype
    scales = {standard(t.dtype) for t in (scale, offset) if t is not None}
    if standard(x.dtype) != "float32" or standard(values.dtype) != ("uint8" if bits == 4 else "int8") or scales not in ({"float32"}, {"float16"}):
        return None
    rows = 1
    for size in x.shape[:-1]:
        rows = None if size is None or rows is None else rows * size
    if rows is None or not 0 < rows <= block_gemv.MAX_ROWS:
        return None
    if backend == "jax":
        import jax

        from attnkit.kernels.quantized import jax_block_gemv as module

        on_cpu = jax.default_backend() == "cpu"
    else:
        import tensorflow as tf

        from attnkit.kernels.quantized import tf_block_gemv as module

        from tensorflow.python.ops import control_flow_util

        # no XLA kernel for the op: a program compiled with jit_compile keeps the dequantize-then-MatMul path
        in_xla = control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
        on_cpu = not tf.config.list_logical_devices("GPU") and not in_xla
    return module if on_cpu and module.available() else None
