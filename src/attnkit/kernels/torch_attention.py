"""torch's attention kernels (docs/decisions.md items 12, 21, 33, 60, 61): two batched GEMMs for bfloat16
on the CPU, torch's SDPA elsewhere (with `enable_gqa` for grouped-query attention), rows with nothing to
attend to repaired off the CPU.

Legend: B batch, h query heads, h_kv key/value heads, T_q/T_k lengths, d_k/d_v widths."""

from attnkit.kernels import onednn, tensor_checks


def attention(queries, keys, values, keep, causal, scale, grouped=False):
    """softmax(scale * Q K^T, masked) V on torch tensors, or None where the explicit path must run.

    Args: as `attnkit.kernels.attention`; with `grouped`, keys and values (..., h_kv, T_k, d) of
    h_kv heads dividing the queries' h (grouped-query attention), read in place (SDPA's `enable_gqa`).

    bfloat16 on the CPU: two batched GEMMs (`bmm_attention`), the explicit path's arithmetic, in which
    NaN and Inf propagate. Otherwise torch's SDPA, except for non-finite inputs, whose NaN and Inf its
    kernels lose on some rows (a NaN query row, or a causal row whose only key is NaN, comes out as
    zeros; docs/decisions.md item 21), and off the CPU with a keep-mask, where its memory-efficient
    kernel averages the values on rows with nothing to attend to: repaired here for h query heads
    (`_accelerator_attention`), left to the caller's repeating path for grouped heads.
    """
    import torch.nn.functional as F

    if bmm_takes(queries, keys, values):
        return bmm_attention(queries, keys, values, keep, causal, scale)
    if not tensor_checks.all_finite(queries, keys, values):
        return None
    if keep is not None and queries.device.type != "cpu":
        return None if grouped else _accelerator_attention(queries, keys, values, keep, scale)
    # torch's CPU kernels already give zero output (and zero gradients) on rows with nothing to attend
    # to (docs/decisions.md item 14); without a keep-mask no row is empty (square causal keeps the diagonal).
    return F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=keep, is_causal=causal, scale=scale, enable_gqa=grouped
    )


# Up to this many query rows per key/value head (h / h_kv heads x T_q queries) the bfloat16 attention
# is two batched GEMMs (`bmm_attention`) whatever the threads; above it, when oneDNN may multiply the
# float32 scores' GEMM in bfloat16 (`_bfloat16_products`), whole sequences whose float32 scores fit
# in BMM_MAX_SCORES_BYTES too; otherwise torch's flash kernel, whose memory does not grow as T_q * T_k.
BMM_MAX_ROWS = 32
BMM_MAX_SCORES_BYTES = 64 * 1024**2
BMM_CHUNK_BYTES = 2 * 1024**2


def bmm_takes(queries, keys, values):
    """Whether `bmm_attention` computes this attention: bfloat16 on the CPU, no autograd graph, queries
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


def bmm_attention(queries, keys, values, keep, causal, scale):
    """softmax(scale * Q K^T, masked) V for bfloat16 torch tensors as batched GEMMs.

    Args: as `kernels.attention`, with queries (..., h, T_q, d_k), keys (..., h_kv, T_k, d_k), values
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
    native = onednn.native_half(torch.bfloat16)
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
            else:  # exact products in float32, rounded once, as `linear.torch_linear` multiplies there
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


def _accelerator_attention(queries, keys, values, keep, scale):
    """torch's SDPA with a keep-mask off the CPU. There the memory-efficient kernel returns an average
    of the values on rows with nothing to attend to (seen on an H100 in float16 and bfloat16), so
    such rows are repaired as for jax's kernel."""
    import torch.nn.functional as F

    keep, has_key = tensor_checks.open_empty_rows(keep)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=keep, scale=scale)
    return out.masked_fill(has_key.logical_not(), 0)
