"""Linear layers' products: activation(x @ kernel + bias) on torch (oneDNN or one GEMM) and tensorflow
(grappler's fused matmul), and the tied embedding's x weight^T (docs/decisions.md items 60, 63, 69, 71)."""

import keras
from keras import ops

from attnkit.kernels import kept, onednn, products, tensor_checks
from attnkit.kernels.quantized import block_gemv


def times_transposed(x, weight, pack=True):
    """x weight^T (..., d_out) for weight (d_out, d_in), the layout of a tied embedding matrix.

    On torch one `torch.nn.functional.linear`, which reads that layout as it is; `keras.ops.einsum`
    elsewhere (a transposed copy of the weight per call costs as much as the product on jax). torch's
    einsum runs a batched GEMM instead: 2.5x the time of the vocabulary projection at batch 8.
    `pack=False` says that `weight` is made anew per call, not worth prepacking (`torch_linear`).
    """
    if tensor_checks.is_torch_tensor(x):
        import torch
        import torch.nn.functional as F

        weight = tensor_checks.value_of(weight)
        if onednn.half_as_float32(x, weight):  # as `torch_linear` multiplies there (docs/decisions.md item 69)
            return times_transposed(x.float(), weight.float(), pack=False).to(x.dtype)
        y = onednn.packed_linear(x, weight, weight, None, None, transposed=False) if pack else None
        if y is not None:
            return y
        if onednn.takes(x, weight, None):
            if tensor_checks.records_graph(x, weight):
                # oneDNN's linear has no backward: under autograd (fine-tuning below a tied vocabulary
                # projection) its gradient was silently zero; `onednn.OneDNNLinear` gives it one
                # (docs/decisions.md item 124).
                return onednn.OneDNNLinear.apply(x, weight.t(), None, False)
            return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "none")
        return F.linear(x, weight)
    # Letters, not an ellipsis: tensorflow's einsum gradient broadcasts an ellipsis operand before
    # reducing it, a (B, T, V, d) tensor for the weight's gradient (130 GB for SmolLM2 at batch 16):
    # fine-tuning failed with an OOM (docs/decisions.md item 124).
    axes = "abcefghijklmnopqrstu"[: len(x.shape) - 1]
    return products.einsum(f"{axes}d,vd->{axes}v", x, weight)


def linear(x, kernel, bias, activation):
    """Fused activation(x @ kernel + bias) on torch, or None (the caller's `keras.ops` path then runs).

    Args:
        x: (..., d_in). kernel: (d_in, d_out), Keras's layout. bias: (d_out,) or None; tensors or Keras
            variables. activation: None, "relu" or "gelu".

    Returns:
        (..., d_out), or None unless the backend is torch and all operands are torch tensors of one
        floating dtype.
    """
    if keras.backend.backend() == "tensorflow":
        return tensorflow_linear(x, kernel, bias, activation)
    if keras.backend.backend() != "torch":
        return None  # XLA folds the bias add and the activation into the product's loop
    import torch

    x, kernel, bias = tensor_checks.value_of(x), kept.variable_value(kernel), kept.variable_value(bias)
    operands = (x, kernel) if bias is None else (x, kernel, bias)
    if not all(isinstance(v, torch.Tensor) and v.dtype == x.dtype for v in operands) or not x.is_floating_point():
        return None
    if kernel.dim() != 2 or (bias is not None and tuple(bias.shape) != (kernel.shape[1],)):
        return None  # a batched kernel or a broadcast bias: keras.ops' matmul and add
    return torch_linear(x, kernel, bias, activation)


def gelu_erf(y):
    """GELU in its erf form, 0.5 y (1 + erf(y / sqrt 2)): the form oneDNN's kernels compute (torch's,
    tensorflow's fused matmul), cheaper under XLA than the erfc form of jax's and tensorflow's GELU,
    less precise in the negative tail (docs/decisions.md items 63 and 66)."""
    return 0.5 * y * (1.0 + ops.erf(y * 0.7071067811865476))


def tensorflow_linear(x, kernel, bias, activation):
    """activation(x @ kernel + bias) for tensorflow tensors of one floating dtype, or None, as the ops
    grappler's remapper fuses into one oneDNN matmul inside a `tf.function` (docs/decisions.md item 63).

    A (rows, d_in) MatMul, a BiasAdd, then Relu or the erf form of GELU: the pattern the remapper
    rewrites into `_MklFusedMatMul`, which adds the bias and applies the activation to the float32
    accumulator before rounding. `keras.ops.matmul` on a (..., d_in) tensor is a Tensordot, an add
    and tensorflow's GELU (`erfc`), which stay separate ops: under `mixed_bfloat16` its bfloat16
    `erfc` alone took as long as the MiniLM encoder's products. Eagerly (no remapper) and under
    XLA the same ops run as written, with the same values.

    Args:
        x: (..., d_in) tensor. kernel: (d_in, d_out). bias: (d_out,) or None; tensors or Keras variables.
        activation: None, "relu" or "gelu".

    Returns:
        (..., d_out) with x's static shape but its last axis, or None unless x is a tensorflow tensor
        (not a symbolic KerasTensor) of rank >= 1 and the operands share its floating dtype.
    """
    import tensorflow as tf

    x, kernel, bias = tensor_checks.value_of(x), kept.variable_value(kernel), kept.variable_value(bias)
    operands = (x, kernel) if bias is None else (x, kernel, bias)
    if not all(isinstance(v, (tf.Tensor, tf.Variable)) for v in operands) or not x.dtype.is_floating:
        return None
    if any(v.dtype != x.dtype for v in operands) or x.shape.rank is None or x.shape.rank < 1:
        return None
    if kernel.shape.rank != 2 or not kernel.shape.is_fully_defined():
        return None
    if bias is not None and bias.shape.as_list() != [kernel.shape[1]]:  # tf.nn.bias_add does not broadcast
        return None
    d_in, d_out = kernel.shape
    if x.shape[-1] != d_in:  # unknown or wrong: the reshape below would not notice; keras.ops raises
        return None
    rows = x if x.shape.rank == 2 else tf.reshape(x, [-1, d_in])  # (rows, d_in)
    wide = tensor_checks.tensorflow_bfloat16_as_float32(x)
    if wide:  # exact casts, one rounding at the end, as oneDNN's bfloat16 kernels compute
        rows, kernel = tf.cast(rows, tf.float32), tf.cast(kernel, tf.float32)
        bias = None if bias is None else tf.cast(bias, tf.float32)
    y = tf.matmul(rows, kernel)  # (rows, d_out)
    if bias is not None:
        y = tf.nn.bias_add(y, bias)
    if activation == "relu":
        y = tf.nn.relu(y)
    elif activation == "gelu":
        y = gelu_erf(y)  # the remapper's GeluExact pattern (tf.nn.gelu's erfc form is not)
    if wide:
        y = tf.cast(y, x.dtype)
    if x.shape.rank == 2:
        return y
    out = tf.reshape(y, tf.concat([tf.shape(x)[:-1], [d_out]], axis=0))  # (..., d_out)
    out.set_shape(x.shape[:-1].concatenate([d_out]))
    return out


def torch_linear(x, kernel, bias, activation=None, pack=True):
    """activation(x @ kernel + bias) for torch tensors of one floating dtype, in one GEMM.

    float32 and bfloat16 products on the CPU run through oneDNN's linear
    (`torch.ops.mkldnn._linear_pointwise`, the kernel torch's own compiler uses for frozen CPU
    models), with the bias and the activation fused into it. Without autograd, on a kernel that can
    be kept, it reads the kernel prepacked in oneDNN's blocked layout, made once (`onednn.packed`), for any
    number of rows (docs/decisions.md item 71). Otherwise: float32 products of two rows or more and
    bfloat16 ones of ONEDNN_BFLOAT16_MIN_ROWS or more, on the plain kernel; under autograd
    (activation None or ReLU) its backward's products run through it too (`onednn.OneDNNLinear`).
    On a CPU without oneDNN's half-precision kernels (AVX2), half-precision products of that many
    rows run as the float32 linear of their exact casts, rounded once (`onednn.half_as_float32`). torch's default CPU GEMM for float32
    is MKL's, which on AMD CPUs runs at AVX2 speed: 2.2x slower than oneDNN on an AVX-512 EPYC
    (docs/decisions.md item 60). Elsewhere (single rows, other dtypes, GELU under autograd) one
    `F.linear` on the kernel's transposed view. On an AVX2 CPU two choices differ (items 155, 156):
    GELU follows the linear (torch's `gelu_`) instead of being oneDNN's post-op, and without autograd
    a plain float32 kernel goes to torch's addmm, which reads it faster than oneDNN reads its view.

    Args:
        x: (..., d_in). kernel: (d_in, d_out). bias: (d_out,) or None. activation: None, "relu" or "gelu".
        pack: False for a kernel made anew per call (a cast), which prepacking would only copy once more.
    """
    import torch
    import torch.nn.functional as F

    weight = kernel.t()  # (d_out, d_in), torch.nn.Linear's layout, as a view
    if _bfloat16_decoding_rows(x, weight, bias):
        # A decoding step's few rows on a CPU without bfloat16 products: the kept (d_out, d_in)
        # bfloat16 weight read once and widened in registers (`block_gemv.bfloat16_gemv`); the same
        # arithmetic as the float32 path below, exact casts and one rounding (decision 139).
        d_in, d_out = kernel.shape
        y = block_gemv.bfloat16_gemv(x.reshape(-1, d_in).float(), onednn.row_major(kernel))  # (rows, d_out) float32
        if bias is not None:
            y += bias.float()
        if activation == "relu":
            torch.relu_(y)
        elif activation == "gelu":
            y = F.gelu(y)
        return y.to(x.dtype).reshape(*x.shape[:-1], d_out)
    if onednn.half_as_float32(x, weight, bias):
        # Half-precision factors multiply exactly in float32, and oneDNN's half-precision kernels
        # accumulate in float32 and round once: the same arithmetic, on a CPU without those kernels.
        f32 = [None if t is None else t.float() for t in (x, kernel, bias)]
        return torch_linear(*f32, activation, pack=False).to(x.dtype)
    if activation == "gelu" and onednn.takes(x, weight, bias, packed=True) and not onednn.gelu_post_op_pays():
        y = torch_linear(x, kernel, bias, None, pack)  # a fresh output: GELU in place where no graph needs it
        return F.gelu(y) if tensor_checks.records_graph(y) else torch.ops.aten.gelu_(y)
    y = onednn.packed_linear(x, kernel, weight, bias, activation, transposed=True) if pack else None
    if y is not None:
        return y
    if onednn.takes(x, weight, bias):
        if tensor_checks.records_graph(x, weight, bias):
            if activation != "gelu":
                return onednn.OneDNNLinear.apply(x, kernel, bias, activation == "relu")
        else:  # not packed: a float32 variable's tensor, a kernel made per call (`kept.packable`)
            if weight.dtype == torch.bfloat16:
                # oneDNN's bfloat16 kernels read a contiguous (d_out, d_in) weight up to 1.4x faster than
                # the transposed view for a few rows (decoding), and no slower for many; in float32 the
                # view is the faster one on an AVX-512 CPU (docs/decisions.md item 60), torch's addmm
                # on the kernel as it lies on an AVX2 one (item 156).
                weight = onednn.row_major(kernel)
            if onednn.view_pays(weight):
                return torch.ops.mkldnn._linear_pointwise(x, weight, bias, activation or "none", [], "none")
    if weight.dtype in (torch.bfloat16, torch.float16) and weight.device.type == "cpu":
        # torch's CPU half-precision GEMM runs ~30x slower on a row-major (d_in, d_out) operand than
        # on a (d_out, d_in) one (0.5 vs 15 GFLOP/s on a 2048x512x2048 bfloat16 product here): the
        # kernel is copied once and kept (`onednn.row_major`).
        weight = onednn.row_major(kernel)
    # One addmm: the bias is added inside the GEMM instead of in a second pass over the output.
    y = F.linear(x, weight, bias)
    if activation == "relu":
        # In place on the GEMM's fresh output: one pass less over (..., d_out); addmm's backward
        # does not need its output, and relu's needs only its result.
        return torch.relu_(y)
    if activation == "gelu":
        return F.gelu(y)
    return y


def _bfloat16_decoding_rows(x, weight, bias):
    """Whether `torch_linear` runs `block_gemv.bfloat16_gemv`: bfloat16 CPU operands (the bias too, or
    none), 1 to `block_gemv.MAX_ROWS` rows, no autograd, no oneDNN bfloat16 kernels, the kernel built."""
    import torch

    if not (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu" and weight.device.type == "cpu"):
        return False
    if (bias is not None and bias.dtype != torch.bfloat16) or x.dim() < 1 or tensor_checks.records_graph(x, weight, bias):
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return 0 < rows <= block_gemv.MAX_ROWS and not onednn.native_half(torch.bfloat16) and block_gemv.available()
