"""Backend-specific attention kernels and projection layouts, each with a `keras.ops` fallback
(docs/decisions.md items 12, 13 and 21).

This is the dispatch module of the attention hot path; it is not the only module that branches on
the backend (token-id checks, `Linear`, the position embedding, inference and the distributed
engines do too, each for its own reason; docs/architecture.md lists them).

`attention` returns None when the backend has no kernel for the case, and the caller falls back to
the explicit `keras.ops` path, which gives the same numbers.

Legend: B batch, h heads, T_q/T_k lengths, d_k/d_v widths.
"""

import functools
import math
import os
import weakref

import keras
from keras import ops
from keras.src.backend.common.stateless_scope import in_stateless_scope  # no public names in Keras 3
from keras.src.backend.common.variables import get_autocast_scope


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
    y = einsum("btc,chd->bthd", x, ops.reshape(kernel, (-1, h, d)))  # (B, T, h, d)
    if bias is not None:
        y = y + ops.reshape(bias, (h, d))
    return ops.transpose(y, (0, 2, 1, 3))


def project_from_heads(heads, kernel, bias):
    """Heads (B, h, T, d) side by side, @ kernel (h * d, d_model) + bias (d_model,) -> (B, T, d_model)."""
    h, d = heads.shape[1], heads.shape[3]
    y = einsum("bhtd,hde->bte", heads, ops.reshape(kernel, (h, d, -1)))
    return y if bias is None else y + bias


def _torch(queries, keys, values, keep, causal, scale):
    import torch.nn.functional as F

    if _bmm_takes(queries, keys, values):
        return _torch_bmm(queries, keys, values, keep, causal, scale)  # the explicit arithmetic: NaN propagates
    if not _finite(queries, keys, values):
        # torch's kernels lose NaN and Inf on some rows (a NaN query row, or a causal row whose only
        # key is NaN, comes out as zeros): the explicit path's arithmetic propagates them.
        return None
    if keep is not None and queries.device.type != "cpu":
        return _torch_accelerator(queries, keys, values, keep, scale)
    # torch's CPU kernels already give zero output (and zero gradients) on rows with nothing to attend
    # to; without a keep-mask no row is empty (square causal keeps the diagonal).
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=keep, is_causal=causal, scale=scale)


# Up to this many query rows per key/value head (h / h_kv heads x T_q queries) the bfloat16 attention
# is two batched GEMMs (`_torch_bmm`) whatever the threads; above it, when oneDNN may multiply the
# float32 scores' GEMM in bfloat16 (`_bfloat16_products`), whole sequences whose float32 scores fit
# in BMM_MAX_SCORES_BYTES too; otherwise torch's flash kernel, whose memory does not grow as T_q * T_k.
BMM_MAX_ROWS = 32
BMM_MAX_SCORES_BYTES = 64 * 1024**2
BMM_CHUNK_BYTES = 2 * 1024**2


def _bmm_takes(queries, keys, values):
    """Whether `_torch_bmm` computes this attention: bfloat16 on the CPU, no autograd graph, queries
    (..., h, T_q, d_k) and keys and values (..., h_kv, T_k, d) with the same leading dimensions and
    h_kv dividing h (grouped-query attention); and either at most BMM_MAX_ROWS query rows per
    key/value head, or float32 scores of at most BMM_MAX_SCORES_BYTES when `_bfloat16_products` can
    be used.

    A decoding step's few queries are where torch's CPU flash kernel loses most: 0.46 ms for SmolLM2's
    B=8, h=9, h_kv=3, T_q=1, T_k=150, against 0.11 ms as two batched GEMMs. For a whole sequence
    (B=16, h=8, T=128) the float32 scores' GEMM in IEEE float32 runs slower than the flash kernel
    (3.8 against 4.4 ms with its finiteness check, 4.9), through oneDNN's bfloat16 products 2.8 ms
    (docs/decisions.md items 60 and 61). With autograd the flash kernel stays: its backward does not
    keep the (T_q, T_k) weights.
    """
    import torch

    if not (queries.dtype == keys.dtype == values.dtype == torch.bfloat16 and queries.device.type == "cpu"):
        return False
    if queries.dim() < 3 or not (queries.shape[:-3] == keys.shape[:-3] == values.shape[:-3]):
        return False
    if not (keys.shape[-3] == values.shape[-3] and keys.shape[-3] > 0 and queries.shape[-3] % keys.shape[-3] == 0):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (queries, keys, values)):
        return False
    if queries.numel() == 0 or keys.shape[-2] == 0:
        return False
    rows = queries.shape[-3] // keys.shape[-3] * queries.shape[-2]
    if rows <= BMM_MAX_ROWS:
        return True
    scores_bytes = queries.numel() // queries.shape[-1] * keys.shape[-2] * 4  # (..., h, T_q, T_k) float32
    return scores_bytes <= BMM_MAX_SCORES_BYTES and _bfloat16_products_safe()


def _bfloat16_products_safe():
    """Whether `_bfloat16_products` may switch torch's process-wide float32 matmul precision: only
    while this is the one Python thread (another could run a float32 matmul meanwhile and get
    bfloat16 products), and when this torch has the switch. A process with other threads, such as a
    notebook's, keeps whole sequences on the flash kernel."""
    import torch

    return _other_python_threads() == 0 and hasattr(torch.backends.mkldnn, "matmul")


def _other_python_threads():
    """How many Python threads are alive besides this one (a notebook's kernel, a server, a data
    loader's threads: any of them could run a float32 matmul)."""
    import threading

    return threading.active_count() - 1


class _bfloat16_products:
    """Within: torch's float32 CPU matmuls multiply in bfloat16 through oneDNN, accumulating and
    returning float32 (`torch.backends.mkldnn.matmul.fp32_precision = "bf16"`). Exact for factors
    that are bfloat16 values cast to float32: a bfloat16 x bfloat16 -> float32 GEMM, which torch has
    no other way to ask for on the CPU (`out_dtype` is CUDA's only), 2.9x faster than IEEE float32
    on an AVX512-BF16 EPYC. Without oneDNN's bfloat16 kernels (AVX2) oneDNN ignores the setting and
    the products are IEEE float32's, as exact for such factors. The setting is process-wide: enter
    only when `_bfloat16_products_safe()`."""

    def __enter__(self):
        import torch

        self.previous = torch.backends.mkldnn.matmul.fp32_precision
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"

    def __exit__(self, *exc):
        import torch

        torch.backends.mkldnn.matmul.fp32_precision = self.previous


def _torch_bmm(queries, keys, values, keep, causal, scale):
    """softmax(scale * Q K^T, masked) V for bfloat16 torch tensors as batched GEMMs.

    Args: as `attention`, with queries (..., h, T_q, d_k), keys (..., h_kv, T_k, d_k), values
    (..., h_kv, T_k, d_v) sharing their leading dimensions, h_kv dividing h; query head j reads key
    and value head j // (h / h_kv), as `repeat_kv` repeats them, without repeating them in memory.
    The scores and the softmax are float32, as in the explicit path and torch's flash kernel (bfloat16
    scores lose up to half a unit at |score| ~ 200): the scores' GEMM multiplies the bfloat16 factors
    exactly and accumulates in float32. The weights are rounded to bfloat16 for the product with V, as
    the flash kernel rounds them. The explicit path's arithmetic: NaN and Inf propagate, and rows with
    nothing to attend to have zero weights.

    The heads run in chunks of about BMM_CHUNK_BYTES of scores, which stay in the cache from their
    GEMM through the softmax to the product with V: the whole (B, h, T_q, T_k) float32 scores at once
    went through memory three times and made the path slower than the flash kernel.
    """
    import contextlib

    import torch

    *lead, h, T_q, d_k = queries.shape
    h_kv, T_k, d_v = keys.shape[-3], keys.shape[-2], values.shape[-1]
    g = h // h_kv  # query heads per key/value head
    # A group's g queries of T_q rows each read the same keys: one (g T_q, T_k) product per group.
    # Groups are indexed (example, key/value head); each chunk's factors are cast to float32 while it
    # runs, into copies that stay in the cache (whole casts went through memory: 0.4 ms a layer).
    q = queries.reshape(-1, h_kv, g, T_q, d_k)  # (E, h_kv, g, T_q, d_k): a view of a projection's heads
    k = keys.reshape(-1, h_kv, T_k, d_k)  # (E, h_kv, T_k, d_k)
    v = values.reshape(-1, h_kv, T_k, d_v)  # (E, h_kv, T_k, d_v)
    n = q.shape[0] * h_kv  # N = E h_kv groups
    drop = has_key = None
    if causal:
        keep = torch.ones(T_q, T_k, dtype=torch.bool, device=q.device).tril_()
    if keep is not None:
        keep = keep.reshape((1,) * (len(lead) + 3 - keep.dim()) + tuple(keep.shape))  # (..., h|1, T_q|1, T_k)
        keep = keep.unflatten(-3, (h_kv, g) if keep.shape[-3] == h else (1, 1))  # (..., h_kv|1, g|1, T_q|1, T_k)
        keep = keep.expand(*lead, h_kv, *keep.shape[-3:]).reshape(n, *keep.shape[-3:])  # (N, g|1, T_q|1, T_k)
        drop = keep.logical_not()
        if not causal:
            has_key = keep.any(dim=-1, keepdim=True)  # (N, g|1, T_q|1, 1)
    out = v.new_empty(n, g * T_q, d_v)
    chunk = max(1, BMM_CHUNK_BYTES // (g * T_q * T_k * 4))  # groups per chunk
    scores = torch.empty(min(chunk, n), g * T_q, T_k, dtype=torch.float32, device=q.device)
    products = _bfloat16_products() if _bfloat16_products_safe() else contextlib.nullcontext()
    native = native_half(torch.bfloat16)
    with products:
        for start, stop, groups in _group_chunks(n, h_kv, chunk):
            part = scores[: stop - start]  # (c, g T_q, T_k)
            q_c = q[groups].to(torch.float32, memory_format=torch.contiguous_format).view(-1, g * T_q, d_k)  # (c, g T_q, d_k)
            k_c = k[groups].to(torch.float32, memory_format=torch.contiguous_format).view(-1, T_k, d_k)  # (c, T_k, d_k)
            torch.baddbmm(part, q_c, k_c.transpose(1, 2), beta=0, alpha=scale, out=part)
            if drop is not None:
                part.view(-1, g, T_q, T_k).masked_fill_(drop[start:stop], float("-inf"))
            weights = torch.softmax(part, dim=-1)  # NaN on rows with no key
            if has_key is not None:
                weights.view(-1, g, T_q, T_k).masked_fill_(has_key[start:stop].logical_not(), 0)
            weights = weights.to(values.dtype)  # rounded as the flash kernel rounds them
            v_c = v[groups].reshape(-1, T_k, d_v)  # (c, T_k, d_v)
            if native:
                torch.bmm(weights, v_c, out=out[start:stop])
            else:  # exact products in float32, rounded once, as `torch_linear` multiplies there
                out[start:stop] = torch.bmm(weights.float(), v_c.float())
    return out.view(*lead, h, T_q, d_v)  # (..., h, T_q, d_v)


def _group_chunks(n, h_kv, chunk):
    """Chunks of at most `chunk` of the n = E h_kv groups, in order: (start, stop, index), `index`
    selecting them from (E, h_kv, ...) tensors as one (examples, heads) block: whole examples when
    a chunk holds one or more, else heads of one example."""
    if chunk >= h_kv:
        per = chunk // h_kv  # whole examples per chunk
        for e in range(0, n // h_kv, per):
            stop = min(n // h_kv, e + per)
            yield e * h_kv, stop * h_kv, slice(e, stop)
    else:
        for e in range(n // h_kv):
            for j in range(0, h_kv, chunk):
                stop = min(h_kv, j + chunk)
                yield e * h_kv + j, e * h_kv + stop, (e, slice(j, stop))


def _finite(*tensors):
    """Whether the sum of all elements of these torch tensors is finite (True for shapes only traced on
    "meta").

    A NaN or an infinity anywhere makes the sum NaN or infinite, so a finite sum proves every element
    finite, in one pass over each tensor (`isfinite(t).all()` took four: 5% of a 6-layer encoder's
    time). The converse can fail: finite elements whose sum overflows float32's range (magnitudes near
    1e34) read as non-finite, and the caller then takes the explicit path, which computes the same numbers.
    """
    import torch

    if any(t.device.type == "meta" for t in tensors):
        return True
    # float32 and bfloat16 (float32's range) are summed in their own dtype, float16 (max 65504) in float32.
    sums = (t.detach().sum(dtype=torch.float32 if t.dtype == torch.float16 else None) for t in tensors)
    return bool(torch.isfinite(sum(s.float() for s in sums)))


def if_finite(tensors, output, fallback):
    """`output` when every element of the jax arrays `tensors` is finite, else `fallback()`: a
    `lax.cond` when traced (only the branch taken runs), a Python choice otherwise. Finite as in
    `_finite`: the float32 sum of each array."""
    import jax
    import jax.numpy as jnp

    finite = jnp.isfinite(sum(jnp.sum(t, dtype=jnp.float32) for t in tensors))
    if not isinstance(finite, jax.core.Tracer):
        return output if bool(finite) else fallback()
    return jax.lax.cond(finite, lambda: output, lambda: fallback().astype(output.dtype))


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


def matmul(a, b, float32_products=False):
    """a @ b by keras.ops.matmul, except for float64 torch tensors: Keras multiplies those in float32
    (its type promotion), which would cost float64 inputs their precision; and for bfloat16 jax
    arrays, whose product XLA computes 2-3x faster when asked for float32 (`_jax_bfloat16`).

    Args:
        a: (..., m, k). b: (..., k, n).
        float32_products: for bfloat16 jax arrays, return the float32 product instead of rounding it
            to bfloat16 (the attention scores). Elsewhere ignored: the caller casts.
    """
    a, b = _tensor(a), _tensor(b)
    if _is_torch_tensor(a) and _is_torch_tensor(b):
        import torch

        if a.dtype == b.dtype == torch.float64:
            return torch.matmul(a, b)
    if _jax_bfloat16(a, b):
        import jax.numpy as jnp

        one_row = a.ndim >= 2 and b.ndim >= 2 and a.shape[-2] == 1 and (b.ndim >= 3 or math.prod(a.shape[:-1]) == 1)
        if one_row:  # (..., 1, k) -> (..., 2, k): see `_jax_bfloat16`
            a = jnp.concatenate([a, jnp.zeros_like(a)], axis=-2)
        y = jnp.matmul(a, b, preferred_element_type=jnp.float32)  # (..., m, n)
        if one_row:
            y = y[..., :1, :]
        return y if float32_products else y.astype(jnp.bfloat16)
    if _tensorflow_bfloat16_as_float32(a, b):
        return ops.cast(ops.matmul(ops.cast(a, "float32"), ops.cast(b, "float32")), "bfloat16")
    return ops.matmul(a, b)


def times_keys(queries, keys, float32_products=False):
    """queries keys^T, (..., T_q, T_k), for queries (..., T_q, d) and keys (..., T_k, d): the attention
    scores' product, `matmul(queries, swapaxes(keys))` but on jax one dot contracting both last axes.

    Given K^T, XLA's CPU fusion moved the transpose into the dot, which then ran as a loop instead of
    its GEMM: MiniLM's (64, 12, 80, 32) bfloat16 attention took 24 ms a layer, against 6 ms
    (docs/decisions.md item 74). bfloat16 jax arrays are multiplied as `matmul` multiplies them
    (float32 products, one row padded); `float32_products` as there.
    """
    queries, keys = _tensor(queries), _tensor(keys)
    if keras.backend.backend() != "jax" or queries.ndim < 2 or keys.ndim < 2:
        return matmul(queries, ops.swapaxes(keys, -1, -2), float32_products)
    import jax.numpy as jnp

    half = _jax_bfloat16(queries, keys)
    one_row = half and queries.shape[-2] == 1
    if one_row:  # (..., 1, d) -> (..., 2, d): see `_jax_bfloat16`
        queries = jnp.concatenate([queries, jnp.zeros_like(queries)], axis=-2)
    y = jnp.einsum("...qd,...kd->...qk", queries, keys, preferred_element_type=jnp.float32 if half else None)
    if one_row:
        y = y[..., :1, :]
    return y.astype(jnp.bfloat16) if half and not float32_products else y


def times_mask(weights, keep):
    """`where(keep, weights, 0)`, for attention weights that only the product with the values reads.

    On jax and tensorflow the forward is `weights * keep`, which XLA's CPU fusion ran 2-4x faster
    than the select (docs/decisions.md item 74), with the select's gradient, `where(keep, g, 0)`:
    multiplied, an overflowed upstream gradient at a masked key (a large value under padding) gave
    inf * 0 = NaN where the select gives 0. On torch: the select.

    Args:
        weights: (..., T_q, T_k) floating. keep: boolean, broadcastable to `weights`.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        return _jax_times_mask()(weights, keep)
    if backend == "tensorflow":
        return _tensorflow_times_mask(_tensor(weights), _tensor(keep))
    return ops.where(keep, weights, ops.zeros((), weights.dtype))


@functools.cache
def _jax_times_mask():
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def times_mask(weights, keep):
        return weights * keep.astype(weights.dtype)

    def forward(weights, keep):
        return times_mask(weights, keep), keep

    def backward(keep, upstream):
        return jnp.where(keep, upstream, jnp.zeros((), upstream.dtype)), None  # the mask: no gradient

    times_mask.defvjp(forward, backward)
    return times_mask


def _tensorflow_times_mask(weights, keep):
    import tensorflow as tf

    @tf.custom_gradient
    def times_mask(weights):
        def backward(upstream):
            return tf.where(keep, upstream, tf.zeros((), upstream.dtype))

        return weights * tf.cast(keep, weights.dtype), backward

    return times_mask(weights)


def einsum(subscripts, *operands):
    """keras.ops.einsum, with bfloat16 jax arrays multiplied as `matmul` multiplies them."""
    operands = tuple(_tensor(x) for x in operands)
    if _jax_bfloat16(*operands):
        import jax.numpy as jnp

        one_row = _einsum_one_row(subscripts, operands)
        if one_row:  # operand 0's leading axis 1 -> 2: see `_jax_bfloat16`
            operands = (jnp.concatenate([operands[0], jnp.zeros_like(operands[0])], axis=0), *operands[1:])
        y = jnp.einsum(subscripts, *operands, preferred_element_type=jnp.float32)
        return (y[:1] if one_row else y).astype(jnp.bfloat16)
    if _tensorflow_bfloat16_as_float32(*operands):
        return ops.cast(ops.einsum(subscripts, *(ops.cast(x, "float32") for x in operands)), "bfloat16")
    return ops.einsum(subscripts, *operands)


def _einsum_one_row(subscripts, operands):
    """Whether a two-operand einsum multiplies one row of its first operand: the axes of operand 0
    absent from operand 1 (its rows, as a GEMM sees them) hold one element, and operand 0's first
    axis (its letter or an ellipsis) is the output's first, so padding that axis pads the output's.
    `subscripts` as attnkit writes them: "btc,chd->bthd", "...d,vd->...v"; operand 1 without an ellipsis."""
    inputs, _, output = subscripts.replace(" ", "").partition("->")
    parts = inputs.split(",")
    if len(parts) != 2 or "..." in parts[1] or not output:
        return False
    first, second = parts
    a = operands[0]
    if "..." in first:
        covered = a.ndim - (len(first) - 3)  # axes the ellipsis stands for
        if not (first.startswith("...") and output.startswith("...") and covered >= 1):
            return False
        first = "#" * covered + first[3:]  # one stand-in letter per ellipsis axis
    elif output[0] != first[0] or first[0] in second:  # a letter shared with operand 1 may broadcast
        return False
    if len(first) != a.ndim or a.ndim == 0 or a.shape[0] != 1:
        return False
    return math.prod(n for letter, n in zip(first, a.shape) if letter not in second) == 1


def _jax_bfloat16(*operands):
    """Whether the backend is jax and the operands jax arrays (or traced ones) of bfloat16.

    XLA's CPU dot of bfloat16 factors runs at ~310 GFLOP/s when its result is bfloat16 and at
    ~900 when asked for float32 products (`preferred_element_type`; a 2048^3 product on an
    AVX512-BF16 EPYC), which a cast then rounds once to bfloat16: the same float32 accumulation
    rounded once, by a faster kernel whose order of additions may differ in the last bit
    (docs/decisions.md item 62). With one row, that dot takes a slow path: (1, 576) x (576, 49152)
    took 29 ms, against 2.7 ms for the same row padded with a row of zeros, which `matmul` and
    `einsum` add and cut off again (item 65).
    """
    if keras.backend.backend() != "jax":
        return False
    import jax
    import jax.numpy as jnp

    return all(isinstance(x, jax.Array) and x.dtype == jnp.bfloat16 for x in operands)


def _tensorflow_bfloat16_as_float32(*operands):
    """Whether tensorflow multiplies these bfloat16 tensors as float32 products of their exact casts:
    on a CPU without oneDNN's bfloat16 kernels (`cpu_has_bfloat16_kernels`), where tensorflow's own
    bfloat16 MatMul rounds partial sums (errors of twice the once-rounded product's on an AVX2
    EPYC, docs/decisions.md item 69)."""
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    if not all(isinstance(x, (tf.Tensor, tf.Variable)) and x.dtype == tf.bfloat16 for x in operands):
        return False
    return not cpu_has_bfloat16_kernels()


@functools.cache
def cpu_has_bfloat16_kernels():
    """Whether this CPU runs oneDNN's bfloat16 kernels (AVX-512 core, AMX or AVX-NE-CONVERT), from
    /proc/cpuinfo's flags; True where they cannot be read (tensorflow's own kernels then run)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.partition(":")[2].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return True
    if flags is None:
        return True
    return bool({"avx512bw", "amx_bf16", "avx_ne_convert"} & set(flags))


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


# (tag, id of each variable) -> (weak references to the variables, their tensors' (id, version), value).
_KEPT = {}


def _kept(variables, tag, make):
    """`make()`, a value computed from these Keras variables' tensors, kept between calls on torch.

    Kept while no autograd graph is recorded through them and each variable still holds the same,
    unchanged tensor (`_stamp`: an assignment in place, a new tensor, or new data under the same
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
    if entry is not None and all(ref() is v for ref, v in zip(entry[0], variables)) and _current(entry[1], stored):
        return entry[2]
    stamps = [_stamp(t) for t in stored]  # before `make`: a write meanwhile makes the value anew next call
    value = _made_outside_inference_mode(make)
    if isinstance(value, torch.Tensor) and all(value is not t for t in stored):
        _KEPT_VALUES[id(value)] = weakref.ref(value, lambda _, i=id(value): _KEPT_VALUES.pop(i, None))
    refs = tuple(weakref.ref(v, lambda _, key=key: _KEPT.pop(key, None)) for v in variables)
    _KEPT[key] = (refs, stamps, value)
    return value


_KEPT_VALUES = {}  # id -> weak reference, of the tensors `_kept` made (`_packable`)


def _stamp(t):
    """What identifies a torch tensor's current values: the tensor (weakly), its version counter (an
    in-place change bumps it), and its storage, held so that its address cannot be reused: assigning
    `.data` (as `Module.to` and `vector_to_parameters` do) changes neither the tensor nor its version."""
    return weakref.ref(t), t._version, t.untyped_storage(), t.storage_offset(), t.shape, t.stride()


def _current(stamps, tensors):
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


def _derived(source, tag, make):
    """`make(source)`, a tensor derived from the torch tensor `source` (a kernel's copy in another
    layout), kept between calls; None where it cannot be kept.

    Kept while `source` itself lives with the same values (`_stamp`) and no autograd graph runs
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
    if entry is not None and _current([entry[0]], [source]):
        return entry[1]
    stamp = _stamp(source)  # before `make`: a write meanwhile makes the value anew next call
    value = _made_outside_inference_mode(lambda: make(source))
    if entry is None or entry[0][0]() is not source:
        weakref.finalize(source, _DERIVED.pop, key, None)  # once per source: gone with it
    _DERIVED[key] = (stamp, value)
    return value


_DERIVED = {}  # (tag, id(source)) -> (the source's `_stamp`, the derived tensor)


def _row_major(kernel):
    """`kernel.t().contiguous()`, the (d_out, d_in) layout of a (d_in, d_out) torch kernel, kept
    between calls where `_derived` can keep it."""
    kept = _derived(kernel, "row_major", lambda k: k.t().contiguous())
    return kernel.t().contiguous() if kept is None else kept


def _packed(weight, transposed):
    """oneDNN's own blocked layout of a linear's weight, made once and kept (`_derived`), or None.

    `weight` is (d_out, d_in), or with `transposed` a (d_in, d_out) kernel. Given a weight in the
    plain layout, oneDNN's linear reorders it into its blocked layout on every call: prepacked
    (`torch.ops.mkldnn._reorder_linear_weight`, what torch's compiler does to frozen CPU models) the
    same products (bit for bit from two rows on), ran 1.03-1.08x faster for 2048 rows and 2-4x faster for a decoding
    step's 1-31 rows, where the reorder is most of the work (docs/decisions.md item 71). Only for
    `_packable` weights; None for others, which oneDNN then reads in the plain layout.
    """
    import torch

    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return None  # a torch without the operator: the plain layout
    if weight.numel() == 0 or not _packable(weight):
        return None  # oneDNN cannot reorder an empty weight (its plain linear returns the empty product)
    if transposed:
        return _derived(weight, "onednn_packed_t", lambda k: torch.ops.mkldnn._reorder_linear_weight(k.t().contiguous(), None))
    return _derived(weight, "onednn_packed", lambda w: torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None))


def _packed_linear(x, source, weight, bias, activation, transposed):
    """activation(x weight^T + bias) by oneDNN's linear on `source` prepacked (`_packed`), or None
    where that path does not apply (autograd, a dtype or shape oneDNN does not take, a source that is
    not `_packable`). `weight` is the (d_out, d_in) weight; `source` the tensor it is read from:
    itself, or with `transposed` the (d_in, d_out) kernel it is a view of."""
    import torch

    if _records_graph(x, weight, bias) or not _onednn_takes(x, weight, bias, packed=True):
        return None
    packed = _packed(source, transposed)
    if packed is None:
        return None
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, activation or "none", [], "none")


def _packable(weight):
    """Whether a packed copy of the torch tensor `weight` may be kept across calls: a value `_kept`
    keeps (a mixed-precision cast, a joined [W_q | W_k | W_v]), or a half-precision variable's
    tensor (a `torch.nn.Parameter`), whose (d_out, d_in) copy item 60 keeps the same way. Packing
    those adds no case where a kept layout could be stale. A float32 variable's tensor is not packed:
    a write through `param.data` (an EMA update, a hand-written optimizer) bypasses the version
    counter `_stamp` follows (decision 71). A tensor made per call (a cast) is not either: it would
    be packed on every call."""
    import torch

    ref = _KEPT_VALUES.get(id(weight))
    if ref is not None and ref() is weight:
        return True
    return type(weight) is torch.nn.Parameter and weight.dtype in (torch.bfloat16, torch.float16)


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
    """The tensors or Keras variables `tensors` (..., n_i), cast to `dtype`, joined along the last axis;
    on torch, for variables, kept between calls (`_kept`)."""
    if keras.backend.backend() == "torch":
        import torch

        def join():
            values = [_tensor(t) for t in tensors]
            if not all(isinstance(v, torch.Tensor) for v in values):
                return None
            return torch.cat([v.to(getattr(torch, dtype)) for v in values], dim=-1)

        if all(isinstance(t, keras.Variable) for t in tensors):
            scope = get_autocast_scope()
            joined = _kept(tensors, ("joined", dtype, scope and scope.dtype), join)
        else:
            joined = join()
        if joined is not None:
            return joined
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
    """Layer normalization of `x` over its last axis on torch tensors, in `x`'s dtype, or None (then
    Keras's layer runs). On tensorflow: `tensorflow_layer_norm`.

    It is the `torch.nn.functional.layer_norm` call keras.ops.layer_normalization itself makes on
    torch, without its dispatch (12 calls in a 6-layer encoder). Half precision is normalized in
    float32 with float32 gamma and beta and cast back, as Keras's layer does under a mixed policy.

    Args:
        x: (..., d). gamma, beta: (d,) Keras variables or tensors, or None. epsilon: float.
    """
    if keras.backend.backend() == "tensorflow":
        return tensorflow_layer_norm(x, gamma, beta, epsilon)
    if not _is_torch_tensor(x):
        return None
    import torch
    import torch.nn.functional as F

    gamma, beta = _tensor(gamma), _tensor(beta)
    wide = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype  # of gamma and beta
    if not all(p is None or (isinstance(p, torch.Tensor) and p.dtype == wide) for p in (gamma, beta)):
        return None
    if x.dtype in (torch.float32, torch.float64):  # Keras's layer computes float64 in float32 on torch
        return F.layer_norm(x, x.shape[-1:], gamma, beta, epsilon)
    if x.dtype in (torch.bfloat16, torch.float16):
        return in_float32_row_chunks(x, lambda rows: F.layer_norm(rows, x.shape[-1:], gamma, beta, epsilon), gamma, beta)
    return None


# A half-precision norm on the CPU widens this many bytes of float32 rows at a time (`in_float32_row_chunks`).
NORM_CHUNK_BYTES = 1024**2


def in_float32_row_chunks(x, norm, *parameters):
    """`norm(x.float()).to(x.dtype)` for a half-precision torch tensor x (..., d) and a row-wise `norm`
    of float32 (rows, d) tensors, the same numbers, computed NORM_CHUNK_BYTES of float32 rows at a time
    on the CPU where no autograd graph is recorded.

    Whole, the float32 copy of a (16, 128, 512) input and the norm's float32 output are 4 MiB each,
    written and read back from memory: a bfloat16 LayerNorm took 2.5 ms cold from the cache, 0.26 ms
    in chunks of 1 MiB (0.5 and 2 MiB were slower), and the bfloat16 encoder row 4.9 ms less
    (docs/decisions.md item 75). torch's mixed-dtype kernel (bfloat16 x, float32 gamma and beta), as
    fast, is not used: it computes x * rstd - mean * rstd, so a constant row of 3000 with epsilon
    1e-6 normalizes to 0.066 instead of 0, and its backward sums beta's gradient imprecisely.

    The whole input is widened at once elsewhere: under autograd (a chunked copy would record a node
    per chunk), off the CPU, inside `torch.func` transforms (their batched tensors cannot be written
    into a plain buffer), and for inputs that are not contiguous (torch's RMSNorm of a strided
    float32 input depends on its layout, so the rows' copies would change the numbers).

    Args:
        x: (..., d) bfloat16 or float16. norm: (rows, d) float32 -> (rows, d) float32, row by row.
        parameters: the norm's torch tensors or None, for the autograd check.
    """
    import torch

    d = x.shape[-1]
    step = max(1, NORM_CHUNK_BYTES // (4 * d)) if d else 0  # rows per chunk
    if not _plain_cpu_tensor(x) or _records_graph(x, *parameters) or x.numel() <= step * d:
        return norm(x.float()).to(x.dtype)
    rows = x.view(-1, d)  # (rows, d)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    for start in range(0, rows.shape[0], step):
        out[start : start + step] = norm(rows[start : start + step].float())  # rounded as .to(x.dtype)
    return out.view(x.shape)


def tensorflow_layer_norm(x, gamma, beta, epsilon):
    """Layer normalization of a tensorflow tensor over its last axis inside a `tf.function`, as one
    XLA-compiled function, or None (eagerly, or other operands: Keras's layer then runs).

    Keras's formula on tensorflow (`keras.ops.layer_normalization`: moments, rsqrt, x * inv + res in
    float32, then cast back) is eleven graph ops, each a pass over (..., d) in float32, which grappler
    does not fuse; compiled as one XLA function it is one pass for the moments and one for the output.
    The bfloat16 encoder row's 12 norms took 10.5 ms less (148.2 -> 137.7 ms), MiniLM's bfloat16
    embeddings 33 ms less (docs/decisions.md item 73). XLA sums the moments in another order than
    tensorflow's reductions: float32 results differ from Keras's by float32 rounding, and 29 of 1M
    bfloat16 ones by one bfloat16 ulp (the float32 result rounded the other way). Keras's layer runs
    where compiling would cost more than it saves or go wrong: eagerly, in a graph traced for shapes
    not fully known (XLA would compile for every new shape as it runs: 60 ms each), and under a
    `tf.distribute` strategy (there the one cached function lost the gradients of all norms but the
    first, with no error).

    Args:
        x: (..., d) float32, bfloat16 or float16. gamma, beta: (d,) float32 variables or tensors.
        epsilon: float.
    """
    import tensorflow as tf

    if not isinstance(x, tf.Tensor) or tf.executing_eagerly() or gamma is None or beta is None:
        return None
    if not x.shape.is_fully_defined():
        return None  # a graph for every shape (`reduce_retracing`): XLA would compile each new one as it runs
    if tf.distribute.has_strategy():
        return None  # under MirroredStrategy the shared compiled function lost the norms' gradients (item 73)
    gamma, beta = _variable_value(gamma), _variable_value(beta)
    if not (x.dtype in (tf.float32, tf.bfloat16, tf.float16) and gamma.dtype == beta.dtype == tf.float32):
        return None
    # Their values, read here: the one cached function given the variables themselves kept the first
    # model's, and a later model's training raised "referencing variables which have been deleted".
    gamma, beta = tf.convert_to_tensor(gamma), tf.convert_to_tensor(beta)
    return _xla_layer_norm()(x, gamma, beta, float(epsilon))


@functools.cache
def _xla_layer_norm():
    """Keras's layer-norm formula on tensorflow as a `tf.function(jit_compile=True)`: x (..., d) in
    any floating dtype, gamma and beta (d,) float32; computed in float32, returned in x's dtype."""
    import tensorflow as tf

    def norm(x, gamma, beta, epsilon):
        wide = tf.cast(x, tf.float32)  # (..., d)
        mean, variance = tf.nn.moments(wide, axes=[-1], keepdims=True)  # (..., 1) each
        inv = tf.math.rsqrt(variance + epsilon) * gamma  # (..., d)
        return tf.cast(wide * inv + (-mean * inv + beta), x.dtype)

    return tf.function(norm, jit_compile=True)


def rms_norm(x, gamma, epsilon):
    """RMS normalization of `x` over its last axis on torch float tensors, or None (then the layer's
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
    if x.dtype in (torch.float32, torch.float64):  # keras.ops.mean computes float64 in float32 on torch
        return F.rms_norm(x, x.shape[-1:], gamma, epsilon)
    if x.dtype in (torch.bfloat16, torch.float16):
        return gamma * in_float32_row_chunks(x, lambda rows: F.rms_norm(rows, x.shape[-1:], None, epsilon))  # (..., d)
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


def times_transposed(x, weight, pack=True):
    """x weight^T (..., d_out) for weight (d_out, d_in), the layout of a tied embedding matrix.

    On torch one `torch.nn.functional.linear`, which reads that layout as it is; `keras.ops.einsum`
    elsewhere (a transposed copy of the weight per call costs as much as the product on jax). torch's
    einsum runs a batched GEMM instead: 2.5x the time of the vocabulary projection at batch 8.
    `pack=False` says that `weight` is made anew per call, not worth prepacking (`torch_linear`).
    """
    if _is_torch_tensor(x):
        import torch
        import torch.nn.functional as F

        weight = _tensor(weight)
        if _half_as_float32(x, weight):  # as `torch_linear` multiplies there (docs/decisions.md item 69)
            return times_transposed(x.float(), weight.float(), pack=False).to(x.dtype)
        y = _packed_linear(x, weight, weight, None, None, transposed=False) if pack else None
        if y is not None:
            return y
        if _onednn_takes(x, weight, None):
            if _records_graph(x, weight):
                # oneDNN's linear has no backward: under autograd (fine-tuning below a tied vocabulary
                # projection) its gradient was silently zero; `_OneDNNLinear` gives it one
                # (docs/decisions.md item 124).
                return _OneDNNLinear.apply(x, weight.t(), None, False)
            return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "none")
        return F.linear(x, weight)
    # Letters, not an ellipsis: tensorflow's einsum gradient broadcasts an ellipsis operand before
    # reducing it, a (B, T, V, d) tensor for the weight's gradient (130 GB for SmolLM2 at batch 16):
    # fine-tuning failed with an OOM (docs/decisions.md item 124).
    axes = "abcefghijklmnopqrstu"[: len(x.shape) - 1]
    return einsum(f"{axes}d,vd->{axes}v", x, weight)


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

    x, kernel, bias = _tensor(x), _variable_value(kernel), _variable_value(bias)
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

    x, kernel, bias = _tensor(x), _variable_value(kernel), _variable_value(bias)
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
    wide = _tensorflow_bfloat16_as_float32(x)
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


# Set ATTNKIT_ONEDNN=0 to run every torch projection through torch's default GEMM (`F.linear`).
ONEDNN = os.environ.get("ATTNKIT_ONEDNN", "1") != "0"


def torch_linear(x, kernel, bias, activation=None, pack=True):
    """activation(x @ kernel + bias) for torch tensors of one floating dtype, in one GEMM.

    float32 and bfloat16 products on the CPU run through oneDNN's linear
    (`torch.ops.mkldnn._linear_pointwise`, the kernel torch's own compiler uses for frozen CPU
    models), with the bias and the activation fused into it. Without autograd, on a kernel that can
    be kept, it reads the kernel prepacked in oneDNN's blocked layout, made once (`_packed`), for any
    number of rows (docs/decisions.md item 71). Otherwise: float32 products of two rows or more and
    bfloat16 ones of ONEDNN_BFLOAT16_MIN_ROWS or more, on the plain kernel; under autograd
    (activation None or ReLU) its backward's products run through it too (`_OneDNNLinear`).
    On a CPU without oneDNN's half-precision kernels (AVX2), half-precision products of that many
    rows run as the float32 linear of their exact casts, rounded once (`_half_as_float32`). torch's default CPU GEMM for float32
    is MKL's, which on AMD CPUs runs at AVX2 speed: 2.2x slower than oneDNN on an AVX-512 EPYC
    (docs/decisions.md item 60). Elsewhere (single rows, other dtypes, GELU under autograd) one
    `F.linear` on the kernel's transposed view.

    Args:
        x: (..., d_in). kernel: (d_in, d_out). bias: (d_out,) or None. activation: None, "relu" or "gelu".
        pack: False for a kernel made anew per call (a cast), which prepacking would only copy once more.
    """
    import torch
    import torch.nn.functional as F

    weight = kernel.t()  # (d_out, d_in), torch.nn.Linear's layout, as a view
    if _half_as_float32(x, weight, bias):
        # Half-precision factors multiply exactly in float32, and oneDNN's half-precision kernels
        # accumulate in float32 and round once: the same arithmetic, on a CPU without those kernels.
        f32 = [None if t is None else t.float() for t in (x, kernel, bias)]
        return torch_linear(*f32, activation, pack=False).to(x.dtype)
    y = _packed_linear(x, kernel, weight, bias, activation, transposed=True) if pack else None
    if y is not None:
        return y
    if _onednn_takes(x, weight, bias):
        if _records_graph(x, weight, bias):
            if activation != "gelu":
                return _OneDNNLinear.apply(x, kernel, bias, activation == "relu")
        else:  # not packed: a float32 variable's tensor, a kernel made per call (`_packable`)
            if weight.dtype == torch.bfloat16:
                # oneDNN's bfloat16 kernels read a contiguous (d_out, d_in) weight up to 1.4x faster than
                # the transposed view for a few rows (decoding), and no slower for many; in float32 the
                # view is the faster one (docs/decisions.md item 60).
                weight = _row_major(kernel)
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, activation or "none", [], "none")
    if weight.dtype in (torch.bfloat16, torch.float16) and weight.device.type == "cpu":
        # torch's CPU half-precision GEMM runs ~30x slower on a row-major (d_in, d_out) operand than
        # on a (d_out, d_in) one (0.5 vs 15 GFLOP/s on a 2048x512x2048 bfloat16 product here): the
        # kernel is copied once and kept (`_row_major`).
        weight = _row_major(kernel)
    # One addmm: the bias is added inside the GEMM instead of in a second pass over the output.
    y = F.linear(x, weight, bias)
    if activation == "relu":
        # In place on the GEMM's fresh output: one pass less over (..., d_out); addmm's backward
        # does not need its output, and relu's needs only its result.
        return torch.relu_(y)
    if activation == "gelu":
        return F.gelu(y)
    return y


# Half-precision products of fewer rows than this run as torch's GEMM (`_onednn_takes`, `_half_as_float32`).
ONEDNN_BFLOAT16_MIN_ROWS = 32


@functools.cache
def native_half(dtype):
    """Whether this CPU's oneDNN multiplies torch's `dtype` (bfloat16 or float16) in its own
    half-precision kernels: bfloat16 from AVX-512 (natively with AVX512-BF16 or AMX) or AVX2-VNNI-2,
    float16 from AVX512-FP16 or AMX-FP16. Without them oneDNN refuses a bfloat16 linear ("could not
    create a primitive descriptor") and torch's own half-precision GEMM runs at ~8 GFLOP/s on an
    AVX2 EPYC, 5x slower than the same product in float32 (docs/decisions.md item 69)."""
    import torch

    supported = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    check = getattr(torch.ops.mkldnn, supported[dtype], None)
    return bool(check is not None and torch.backends.mkldnn.is_available() and check())


def _half_as_float32(x, weight, bias=None):
    """Whether `torch_linear` multiplies these half-precision torch tensors (bfloat16 or float16, the
    bias too) in float32 on exact casts: on the CPU, ONEDNN_BFLOAT16_MIN_ROWS rows or more, where
    oneDNN has no native kernels for the dtype (`native_half`). Fewer rows stay in torch's half-precision GEMM, which reads the kernel
    once, where the cast would read it and write it twice as wide."""
    import torch

    if not (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.device.type == "cpu"):
        return False
    if bias is not None and bias.dtype != x.dtype:
        return False  # torch's own GEMM refuses the mix, as it does for fewer rows
    return x.dim() >= 2 and x.numel() >= ONEDNN_BFLOAT16_MIN_ROWS * x.shape[-1] > 0 and not native_half(x.dtype)


def _onednn_takes(x, weight, bias, packed=False):
    """Whether oneDNN's linear computes x weight^T + bias for these torch tensors, x (..., d_in) and
    weight (d_out, d_in), contiguous or a transposed view of a contiguous (d_in, d_out) kernel: on the
    CPU, float32 or bfloat16, the latter where the CPU has oneDNN's bfloat16 kernels (`native_half`).
    With a weight in the plain layout, at least two float32 rows (for one row torch's GEMV is as fast
    or faster) or ONEDNN_BFLOAT16_MIN_ROWS bfloat16 ones; with a `packed` one any number of rows:
    without the per-call reorder the linear beats torch's GEMM at one row too (decision 71)."""
    import torch

    if not (ONEDNN and x.dtype in (torch.float32, torch.bfloat16) and weight.dtype == x.dtype):
        return False
    if torch.compiler.is_compiling():
        # torch.compile (Keras's jit_compile=True): Inductor lowers oneDNN's linear only on weights it
        # packed itself and failed on ours; it picks its own GEMMs (docs/decisions.md item 84).
        return False
    if any(t is not None and t.device.type != "cpu" for t in (x, weight, bias)):
        return False  # oneDNN's operators are the CPU's: elsewhere torch's own kernels, or its device error
    if x.dtype == torch.bfloat16 and not native_half(x.dtype):
        return False
    if not (x.dim() >= 2 and x.numel() >= (1 if packed else 2) * x.shape[-1] > 0 and weight.dim() == 2):
        return False
    if bias is not None and bias.dtype != x.dtype:
        return False
    if x.dtype == torch.bfloat16 and not packed and x.numel() < ONEDNN_BFLOAT16_MIN_ROWS * x.shape[-1]:
        # A decoding step's few rows: torch's bfloat16 GEMM (oneDNN too, on a kept (d_out, d_in) copy)
        # ran 1.1-1.3x faster than the linear primitive inside SmolLM2's step at batch 8.
        return False
    if not (weight.is_contiguous() or weight.t().is_contiguous()):
        return False
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled and _has_onednn_linear()


def _plain_cpu_tensor(x):
    """Whether x is a contiguous torch.Tensor on the CPU, neither a subclass nor wrapped by a
    `torch.func` transform (vmap, grad): one whose memory a loop may write chunk by chunk."""
    import torch

    if type(x) is not torch.Tensor or x.device.type != "cpu" or not x.is_contiguous():
        return False
    return not torch._C._functorch.is_functorch_wrapped_tensor(x)


def _records_graph(*tensors):
    """Whether autograd records an operation on these torch tensors (None entries ignored)."""
    import torch

    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _onednn_linear_class():
    import torch

    class OneDNNLinear(torch.autograd.Function):
        """activation(x @ kernel + bias), activation None or ReLU, by oneDNN forward and backward.

        oneDNN's linear operator has no backward of its own. The backward's products are linears too:
        dX = dY kernel^T is a linear of dY with `kernel` as its (d_in, d_out) weight; dK = X^T dY a
        linear of X^T with dY^T as weight. Under `create_graph` the backward runs torch's own
        differentiable products instead, so second derivatives are torch's.
        """

        @staticmethod
        def forward(ctx, x, kernel, bias, relu):
            # x (..., d_in), kernel (d_in, d_out), bias (d_out,) or None -> (..., d_out)
            y = torch.ops.mkldnn._linear_pointwise(x, kernel.t(), bias, "relu" if relu else "none", [], "none")
            ctx.save_for_backward(x, kernel, y if relu else None)
            ctx.relu = relu
            return y

        @staticmethod
        def backward(ctx, grad):
            x, kernel, y = ctx.saved_tensors
            grad = grad.contiguous()  # the gradient of a sum arrives expanded, with strides of 0
            if ctx.relu:
                grad = grad.masked_fill(y <= 0, 0)  # ReLU's gradient: 0 where the output is 0
            grad_rows, x_rows = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])  # (M, d_out), (M, d_in)
            needs_x, needs_kernel, needs_bias, _ = ctx.needs_input_grad
            # create_graph: differentiable products; torch.compile: Inductor's, as in `_onednn_takes`
            if torch.is_grad_enabled() or torch.compiler.is_compiling():
                grad_x = grad @ kernel.t() if needs_x else None
                grad_kernel = x_rows.t() @ grad_rows if needs_kernel else None
            else:
                lp = torch.ops.mkldnn._linear_pointwise
                grad_x = lp(grad, kernel, None, "none", [], "none") if needs_x else None  # (..., d_in)
                grad_kernel = lp(x_rows.t(), grad_rows.t(), None, "none", [], "none") if needs_kernel else None  # (d_in, d_out)
            grad_bias = grad_rows.sum(0) if needs_bias else None  # (d_out,)
            return grad_x, grad_kernel, grad_bias, None

    return OneDNNLinear


class _LazyFunction:
    """The autograd Function made on first use (torch is imported only on the torch backend)."""

    def __init__(self, make):
        self.make, self.function = make, None

    def apply(self, *args):
        if self.function is None:
            self.function = self.make()
        return self.function.apply(*args)


_OneDNNLinear = _LazyFunction(_onednn_linear_class)


def _has_onednn_linear():
    import torch

    return hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _variable_value(variable):
    """A Keras variable's value, as `variable.value` reads it; `variable` itself if it is a tensor.

    Inside a mixed-precision layer's call Keras casts a float32 variable to the compute dtype on every
    read: a pass over the weights per call. On torch that cast is kept between calls (`_kept`), as
    torch's autocast keeps its casts within one context.
    """
    if not isinstance(variable, keras.Variable):
        return variable
    scope = get_autocast_scope()
    if keras.backend.backend() != "torch" or scope is None or scope.dtype is None or not variable._autocast:
        return variable.value
    return _kept([variable], ("cast", scope.dtype), lambda: variable.value)
