"""Grouped-query and multi-query attention (Ainslie et al., "GQA", 2023; Shazeer, "MQA", 2019).

h query heads share h_kv key/value heads, h_kv dividing h: query head i reads key/value head
i // (h / h_kv). h_kv = h is multi-head attention, h_kv = 1 multi-query attention.

On torch, `torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)` reads the shared
heads in place: K and V are not repeated in memory (docs/decisions.md item 33). Elsewhere, and for
the explicit path that returns the weights, K and V are repeated to h heads first.

Legend: B batch, h query heads, h_kv key/value heads, T_q/T_k lengths, d_k/d_v widths.
"""

from keras import ops

from attnkit import kernels
from attnkit.ops.attention import (
    check_dtypes,
    check_widths,
    default_scale,
    fused_attention,
    keep_mask,
    scaled_dot_product_attention,
)


def repeat_kv(x, groups):
    """(B, h_kv, T, d) -> (B, h_kv * groups, T, d), each key/value head repeated `groups` times in a row."""
    if groups == 1:
        return x
    return ops.repeat(x, groups, axis=1)


def check_groups(queries, keys, values):
    """The number of query heads per key/value head, h / h_kv; raises unless h_kv divides h."""
    for name, x in (("queries", queries), ("keys", keys), ("values", values)):
        if len(x.shape) != 4:
            raise ValueError(f"`{name}` must have rank 4, (B, heads, T, d). Received: {name}.shape={tuple(x.shape)}")
    h, h_kv = queries.shape[1], keys.shape[1]
    if values.shape[1] != h_kv or h % h_kv:
        raise ValueError(
            "`keys` and `values` must have the same number of heads h_kv, dividing the queries' h. Received "
            f"shapes: queries={tuple(queries.shape)}, keys={tuple(keys.shape)}, values={tuple(values.shape)}"
        )
    return h // h_kv


def grouped_query_attention(
    queries, keys, values, mask=None, *, causal=False, scale=None, dropout=0.0, training=False, seed=None,
    return_attention_weights=False,
):
    """Attention of h query heads over h_kv shared key/value heads.

    Args:
        queries: (B, h, T_q, d_k).
        keys: (B, h_kv, T_k, d_k).
        values: (B, h_kv, T_k, d_v).
        mask, causal, scale, dropout, training, seed: as in `fused_attention`; a mask broadcasts to
            (B, h, T_q, T_k).
        return_attention_weights: also return the weights (B, h, T_q, T_k) (explicit path).

    Returns:
        (B, h, T_q, d_v), and the weights when `return_attention_weights`.

    Raises:
        ValueError: ranks other than 4, h_kv not dividing h, other mismatched shapes, a width of 0.
        TypeError: queries, keys or values not floating-point, or not of one dtype.

    Example:
    >>> q, kv = keras.random.normal((2, 9, 5, 64)), keras.random.normal((2, 3, 5, 64))
    >>> grouped_query_attention(q, kv, kv, causal=True).shape  # (2, 9, 5, 64)
    """
    check_dtypes(queries, keys, values)  # before torch's GQA kernel, which refuses mixed dtypes its own way
    queries, keys, values = (ops.convert_to_tensor(x) for x in (queries, keys, values))
    groups = check_groups(queries, keys, values)
    check_widths(queries, keys, values)
    options = dict(causal=causal, scale=scale, dropout=dropout, training=training, seed=seed)
    if return_attention_weights:
        return scaled_dot_product_attention(queries, repeat_kv(keys, groups), repeat_kv(values, groups), mask, **options)
    if groups > 1 and kernels.is_torch_tensor(queries) and not (dropout > 0 and training):
        output = _torch_gqa(queries, keys, values, mask, causal, scale)
        if output is not None:
            return output
    return fused_attention(queries, repeat_kv(keys, groups), repeat_kv(values, groups), mask, **options)


def _torch_gqa(queries, keys, values, mask, causal, scale):
    """torch's attention kernel on the shared heads in place (`kernels.attention(..., grouped=True)`),
    or None where the repeating path must run: non-finite inputs, and off the CPU with a mask
    (docs/decisions.md item 21); the repeating path repairs both."""
    scores_shape = (*queries.shape[:-1], keys.shape[-2])
    scale = default_scale(queries, scale)
    q_len, k_len = queries.shape[-2], keys.shape[-2]
    if causal and mask is None and q_len == k_len:
        keep, fused_causal = None, True
    else:
        keep, fused_causal = keep_mask(mask, causal, scores_shape, (q_len, k_len)), False
    return kernels.attention(queries, keys, values, keep, fused_causal, scale, grouped=True)
