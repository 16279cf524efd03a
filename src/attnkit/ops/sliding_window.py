"""Sliding-window causal masks (Mistral; Beltagy et al., "Longformer", 2020).

Query i may attend to key j when i - window < j <= i: the look-ahead mask of `causal_mask`, further
limited to the last `window` positions, the query's own included. Masks are keep-masks, True = may
attend (`attnkit.ops.masks`).

Legend: T_q/T_k query/key lengths.
"""

from keras import ops

from attnkit._validation import positive_int


def sliding_window_mask(q_len, k_len=None, window=None, *, offset=None):
    """(T_q, T_k) boolean keep-mask: causal, and at most `window` keys per query.

    Args:
        q_len: number of queries.
        k_len: number of keys; default `q_len`.
        window: the number of most recent positions each query sees (its own included); must be
            a positive integer. `window >= k_len` gives the plain causal mask.
        offset: key position of the first query; default T_k - T_q (queries aligned to the end of
            the keys, as in cached decoding).

    Returns:
        (T_q, T_k) bool tensor.

    Raises:
        ValueError, TypeError: non-positive lengths or window.

    Example:
    >>> sliding_window_mask(4, window=2)  # each row keeps its own position and the one before
    """
    q_len = positive_int("q_len", q_len)
    k_len = q_len if k_len is None else positive_int("k_len", k_len)
    window = positive_int("window", window)
    offset = k_len - q_len if offset is None else int(offset)
    rows = ops.expand_dims(ops.arange(q_len), 1) + offset  # (T_q, 1) query positions
    cols = ops.expand_dims(ops.arange(k_len), 0)  # (1, T_k) key positions
    return ops.logical_and(cols <= rows, cols > rows - window)


def window_keep(query_positions, key_positions, window=None):
    """Keep-mask from explicit positions: key j visible to query i when k_j <= q_i (and within `window`).

    Args:
        query_positions: (B, T_q) integer positions.
        key_positions: (B, T_k) integer positions.
        window: None (plain causal) or a positive integer.

    Returns:
        (B, 1, T_q, T_k) bool tensor, one mask for every head.
    """
    q = ops.expand_dims(ops.expand_dims(query_positions, -1), 1)  # (B, 1, T_q, 1)
    k = ops.expand_dims(ops.expand_dims(key_positions, 1), 1)  # (B, 1, 1, T_k)
    keep = k <= q
    if window is not None:
        keep = ops.logical_and(keep, k > q - positive_int("window", window))
    return keep
