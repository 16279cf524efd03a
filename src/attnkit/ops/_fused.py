"""Backend-specific attention kernels and projection layouts, each with a `keras.ops` fallback
(docs/decisions.md items 12, 13 and 21).

This is the dispatch module of the attention hot path; it is not the only module that branches on
the backend (token-id checks, `Linear`, the position embedding, inference and the distributed
engines do too, each for its own reason; docs/architecture.md lists them).

`attention` returns None when the backend has no kernel for the case, and the caller falls back to
the explicit `keras.ops` path, which gives the same numbers.

Legend: B batch, h heads, T_q/T_k lengths, d_k/d_v widths.
"""

import weakref

import keras
from keras import ops


def memory_efficient():
    """Whether the backend has a kernel that never materializes the (..., T_q, T_k) scores: torch's
    SDPA (flash on CPU) and jax's accelerator kernels; not jax's CPU implementation (XLA's), and
    tensorflow has none."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.default_backend() != "cpu"
    return backend == "torch"


def has_kernel(queries, values):
    """Whether `attention` runs a memory-efficient kernel for these inputs, (..., T_q, d_k) and
    (..., T_k, d_v), instead of returning None."""
    if keras.backend.backend() == "jax":
        return memory_efficient() and _jax_takes(queries, values)
    return memory_efficient()


def _jax_takes(queries, values):
    import jax

    # jax's kernel takes exactly (B, T, h, d), one width for keys and values, and float32 or half;
    # on CPU its float16 version does not compile under jit ("precision 'F16_F16_F32' is not supported").
    dtypes = ("float32", "bfloat16") if jax.default_backend() == "cpu" else ("float32", "float16", "bfloat16")
    return (
        len(queries.shape) == 4
        and queries.shape[-1] == values.shape[-1]
        and keras.backend.standardize_dtype(queries.dtype) in dtypes
    )


def attention(queries, keys, values, keep, causal, scale):
    """Fused softmax(scale * Q K^T, masked) V.

    Args:
        queries, keys, values: (..., T_q, d_k), (..., T_k, d_k), (..., T_k, d_v).
        keep: None or a boolean keep-mask already broadcastable to (..., T_q, T_k).
        causal: True only when T_q == T_k and `keep` is None (then the kernels' top-left alignment
            agrees with attnkit's bottom-right one).
        scale: float.

    Returns:
        (..., T_q, d_v), or None when no fused kernel applies.
    """
    backend = keras.backend.backend()
    if backend == "torch":
        return _torch(queries, keys, values, keep, causal, scale)
    if backend == "jax" and memory_efficient():
        # On CPU jax's kernel is XLA's own matmul-softmax-matmul, which materializes the scores like
        # the explicit path and measured slower than it (docs/performance.md, "Measurements behind the code").
        return _jax(queries, keys, values, keep, causal, scale)
    return None


def fuses_projections():
    """Whether projections of one input run as one matmul against their kernels side by side
    ([W_q | W_k | W_v]): on torch, where it is as fast or faster. XLA (jax, tensorflow) runs the
    three dots faster than the concatenated one plus the concatenation (docs/decisions.md item 13)."""
    return keras.backend.backend() == "torch"


def projects_into_heads():
    """Whether projections go into and out of the heads with einsums against the kernels viewed as
    (d_in, h, d) and (h, d, d_model), instead of a matmul and a reshape-transpose of its result: on
    jax, where XLA then picks layouts that need fewer transposes; not on tensorflow, whose einsum
    transposes (docs/decisions.md item 13)."""
    return keras.backend.backend() == "jax"


def project_into_heads(x, kernel, bias, h, d):
    """(B, T, d_in) @ kernel (d_in, h * d) + bias (h * d,) -> (B, h, T, d)."""
    y = ops.einsum("btc,chd->bthd", x, ops.reshape(kernel, (-1, h, d)))  # (B, T, h, d)
    if bias is not None:
        y = y + ops.reshape(bias, (h, d))
    return ops.transpose(y, (0, 2, 1, 3))


def project_from_heads(heads, kernel, bias):
    """Heads (B, h, T, d) side by side, @ kernel (h * d, d_model) + bias (d_model,) -> (B, T, d_model)."""
    h, d = heads.shape[1], heads.shape[3]
    y = ops.einsum("bhtd,hde->bte", heads, ops.reshape(kernel, (h, d, -1)))
    return y if bias is None else y + bias


def _torch(queries, keys, values, keep, causal, scale):
    import torch.nn.functional as F

    if not _finite(queries, keys, values):
        # torch's kernels lose NaN and Inf on some rows (a NaN query row, or a causal row whose only
        # key is NaN, comes out as zeros): the explicit path's arithmetic propagates them.
        return None
    if keep is not None and queries.device.type != "cpu":
        return _torch_accelerator(queries, keys, values, keep, scale)
    # torch's CPU kernels already give zero output (and zero gradients) on rows with nothing to attend
    # to; without a keep-mask no row is empty (square causal keeps the diagonal).
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=keep, is_causal=causal, scale=scale)


def _finite(*tensors):
    """Whether the sum of all elements of these torch tensors, in float32, is finite (True for shapes
    only traced on "meta").

    A NaN or an infinity anywhere makes the sum NaN or infinite, so a finite sum proves every element
    finite, in one pass over each tensor (`isfinite(t).all()` took four: 5% of a 6-layer encoder's
    time). The converse can fail: finite elements whose sum overflows float32 (magnitudes near 1e34)
    read as non-finite, and the caller then takes the explicit path, which computes the same numbers.
    """
    import torch

    if any(t.device.type == "meta" for t in tensors):
        return True
    return bool(torch.isfinite(sum(t.detach().sum(dtype=torch.float32) for t in tensors)))


def _torch_accelerator(queries, keys, values, keep, scale):
    """torch's SDPA with a keep-mask off the CPU. There the memory-efficient kernel returns an average
    of the values on rows with nothing to attend to (seen on an H100 in float16 and bfloat16), so
    such rows are repaired as for jax's kernel."""
    import torch.nn.functional as F

    keep, has_key = _open_empty_rows(keep)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=keep, scale=scale)
    return out.masked_fill(has_key.logical_not(), 0)


def _open_empty_rows(keep):
    """(keep with its empty rows opened to every key, has_key (..., T_q|1, 1)).

    Kernels that fill masked scores with a large negative number make a row with no key left uniform
    rather than empty: letting such rows see everything keeps the kernel finite, and the caller then
    zeroes their output, which also zeroes their gradients.
    """
    has_key = ops.any(keep, axis=-1, keepdims=True)
    return ops.logical_or(keep, ops.logical_not(has_key)), has_key


def _jax(queries, keys, values, keep, causal, scale):
    import jax

    if not _jax_takes(queries, values):
        return None
    has_key = None
    if keep is not None:
        keep, has_key = _open_empty_rows(keep)  # jax fills masked scores with a large negative number
    # jax wants (B, T, h, d); attnkit's layout is (B, h, T, d).
    out = jax.nn.dot_product_attention(
        ops.swapaxes(queries, 1, 2), ops.swapaxes(keys, 1, 2), ops.swapaxes(values, 1, 2),
        mask=keep, scale=scale, is_causal=causal,
    )
    out = ops.swapaxes(out, 1, 2)  # (B, h, T_q, d_v)
    if has_key is not None:
        out = ops.where(has_key, out, ops.zeros((), out.dtype))
    return out


def matmul(a, b):
    """a @ b by keras.ops.matmul, except for float64 torch tensors: Keras multiplies those in float32
    (its type promotion), which would cost float64 inputs their precision."""
    if _is_torch_tensor(a) and _is_torch_tensor(b):
        import torch

        if a.dtype == b.dtype == torch.float64:
            return torch.matmul(a, b)
    return ops.matmul(a, b)


def _is_torch_tensor(x):
    """Whether the backend is torch and `x` one of its tensors (not a NumPy array or a KerasTensor)."""
    if keras.backend.backend() != "torch":
        return False
    import torch

    return isinstance(x, torch.Tensor)


def _tensor(v):
    """A Keras variable's value (cast to the compute dtype inside a mixed-precision layer's call), or
    `v` itself."""
    return v.value if isinstance(v, keras.Variable) else v


# id(variable) -> (weak reference to it, (id, version) of the value copied, the (d_out, d_in) copy).
_ROW_MAJOR = {}


def _row_major(variable, kernel):
    """`kernel.t().contiguous()`, the (d_out, d_in) layout of a (d_in, d_out) torch kernel; kept between
    calls when `kernel` is the Keras `variable`'s own value and no autograd graph is being recorded.
    An assignment (in place, bumping the tensor's version) or a new value makes a new copy."""
    import torch

    own = isinstance(variable, keras.Variable) and variable._value is kernel
    if not own or (kernel.requires_grad and torch.is_grad_enabled()):
        return kernel.t().contiguous()  # (d_out, d_in)
    stamp = (id(kernel), kernel._version)
    entry = _ROW_MAJOR.get(id(variable))
    if entry is not None and entry[0]() is variable and entry[1] == stamp:
        return entry[2]
    copy = kernel.t().contiguous()  # (d_out, d_in)
    key = id(variable)
    _ROW_MAJOR[key] = (weakref.ref(variable, lambda _, key=key: _ROW_MAJOR.pop(key, None)), stamp, copy)
    return copy


def split_heads(x, h, d):
    """(B, T, h * d) -> (B, h, T, d): the heads of a projection, as a view where the backend has views.

    On torch tensors `view` and `transpose` directly: keras.ops.reshape flattens its arguments to
    look for symbolic tensors, a cost many times that of torch.reshape, and keras.ops.shape and
    transpose add as much again (docs/performance.md, "Measurements behind the code").
    """
    if _is_torch_tensor(x):
        B, T = x.shape[0], x.shape[1]
        return x.reshape(B, T, h, d).transpose(1, 2)
    B, T = ops.shape(x)[0], ops.shape(x)[1]
    return ops.transpose(ops.reshape(x, (B, T, h, d)), (0, 2, 1, 3))


def merge_heads(x):
    """(B, h, T, d) -> (B, T, h * d): the heads side by side, as the output projection reads them."""
    if _is_torch_tensor(x):
        B, h, T, d = x.shape
        return x.transpose(1, 2).reshape(B, T, h * d)
    B, T = ops.shape(x)[0], ops.shape(x)[2]
    return ops.reshape(ops.transpose(x, (0, 2, 1, 3)), (B, T, x.shape[1] * x.shape[3]))


def concat_last(tensors, dtype):
    """The tensors or Keras variables `tensors` (..., n_i), cast to `dtype`, joined along the last axis."""
    if keras.backend.backend() == "torch":
        import torch

        values = [_tensor(t) for t in tensors]
        if all(isinstance(v, torch.Tensor) for v in values):
            torch_dtype = getattr(torch, dtype)
            return torch.cat([v.to(torch_dtype) for v in values], dim=-1)
    return ops.concatenate([ops.cast(t, dtype) for t in tensors], axis=-1)


def split_last(x, sizes):
    """`x` (..., sum(sizes)) split along its last axis into parts (..., size), in order.

    On torch `torch.split`: views, and a backward that concatenates the parts' gradients. Slicing
    would be views too, but each slice's backward fills a zero tensor as wide as `x` and the parts
    are added up; keras.ops.split dispatches slowly on torch (docs/performance.md, "Measurements
    behind the code"). Under XLA (jax, tensorflow), slices, which it fuses.
    """
    if _is_torch_tensor(x):
        import torch

        return list(torch.split(x, list(sizes), dim=-1))
    parts, start = [], 0
    for size in sizes:
        parts.append(x[..., start : start + size])
        start += size
    return parts


def layer_norm(x, gamma, beta, epsilon):
    """Layer normalization of `x` over its last axis on torch float32 tensors, or None (then Keras's
    layer runs).

    It is the `torch.nn.functional.layer_norm` call keras.ops.layer_normalization itself makes on
    torch, without its dispatch (12 calls in a 6-layer encoder). Half precision, which
    Keras normalizes in float32, is left to Keras.

    Args:
        x: (..., d). gamma, beta: (d,) Keras variables or tensors, or None. epsilon: float.
    """
    if not _is_torch_tensor(x):
        return None
    import torch
    import torch.nn.functional as F

    if x.dtype != torch.float32:
        return None
    gamma, beta = _tensor(gamma), _tensor(beta)
    return F.layer_norm(x, x.shape[-1:], gamma, beta, epsilon)


def rms_norm(x, gamma, epsilon):
    """RMS normalization of `x` over its last axis on torch float32 tensors, or None (then the layer's
    `keras.ops` path runs).

    One `torch.nn.functional.rms_norm` call instead of six dispatched operations (61 norms in a
    SmolLM2 decoding step). Half precision is normalized in float32 and scaled in its own dtype, as
    the layer's `keras.ops` path does.

    Args:
        x: (..., d). gamma: (d,) Keras variable or tensor. epsilon: float.
    """
    if not _is_torch_tensor(x):
        return None
    import torch
    import torch.nn.functional as F

    gamma = _tensor(gamma)
    if not isinstance(gamma, torch.Tensor) or gamma.dtype != x.dtype:
        return None
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], gamma, epsilon)
    if x.dtype in (torch.bfloat16, torch.float16):
        return gamma * F.rms_norm(x.float(), x.shape[-1:], None, epsilon).to(x.dtype)  # (..., d)
    return None


def rotate(x, cos, sin):
    """x * cos + rotate_half(x) * sin on torch tensors, cos and sin cast to x's dtype, or None (then
    `keras.ops`).

    x: (B, h, T, d); cos, sin: (B or 1, 1, T, d). The rotation runs twice per layer and decoding step:
    keras.ops' dispatch cost more than its arithmetic there.
    """
    if not _is_torch_tensor(x):
        return None
    import torch

    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)):
        return None
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)  # (B, h, T, d/2) each
    return torch.addcmul(x * cos, torch.cat((-x2, x1), dim=-1), sin)


def times_transposed(x, weight):
    """x weight^T (..., d_out) for weight (d_out, d_in), the layout of a tied embedding matrix.

    On torch one `torch.nn.functional.linear`, which reads that layout as it is; `keras.ops.einsum`
    elsewhere (a transposed copy of the weight per call costs as much as the product on jax). torch's
    einsum runs a batched GEMM instead: 2.5x the time of the vocabulary projection at batch 8.
    """
    if _is_torch_tensor(x):
        import torch.nn.functional as F

        return F.linear(x, _tensor(weight))
    return ops.einsum("...d,vd->...v", x, weight)


def linear(x, kernel, bias, activation):
    """Fused activation(x @ kernel + bias) on torch, or None (the caller's `keras.ops` path then runs).

    Args:
        x: (..., d_in). kernel: (d_in, d_out), Keras's layout. bias: (d_out,) or None; tensors or Keras
            variables. activation: None, "relu" or "gelu".

    Returns:
        (..., d_out), or None unless the backend is torch and all operands are torch tensors of one
        floating dtype.
    """
    if keras.backend.backend() != "torch":
        return None  # XLA (jax, tensorflow under tf.function) folds the bias add and picks the layout
    import torch
    import torch.nn.functional as F

    variable = kernel
    x, kernel, bias = _tensor(x), _tensor(kernel), _tensor(bias)
    operands = (x, kernel) if bias is None else (x, kernel, bias)
    if not all(isinstance(v, torch.Tensor) and v.dtype == x.dtype for v in operands) or not x.is_floating_point():
        return None
    weight = kernel.t()  # (d_out, d_in), torch.nn.Linear's layout, as a view
    if weight.dtype in (torch.bfloat16, torch.float16) and weight.device.type == "cpu":
        # torch's CPU half-precision GEMM runs ~30x slower on a row-major (d_in, d_out) operand than
        # on a (d_out, d_in) one (0.5 vs 15 GFLOP/s on a 2048x512x2048 bfloat16 product here). A
        # kernel cast by autocast is a fresh tensor each call, and its copy costs what the cast did;
        # a half-precision variable's own value is copied once and kept (`_row_major`).
        weight = _row_major(variable, kernel)
    # One addmm: the bias is added inside the GEMM instead of in a second pass over the output.
    y = F.linear(x, weight, bias)
    if activation == "relu":
        # In place on the GEMM's fresh output: one pass less over (..., d_out); addmm's backward
        # does not need its output, and relu's needs only its result.
        return torch.relu_(y)
    if activation == "gelu":
        return F.gelu(y)
    return y
