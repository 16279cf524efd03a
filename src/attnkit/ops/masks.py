"""Attention masks: one convention, `True` (or a nonzero integer) = may attend (docs/decisions.md
items 1, 2 and 18).

This is the convention of Keras, JAX, torch SDPA's boolean `attn_mask` and Hugging Face's
`attention_mask`. The seeds use the opposite (1 = hide) and torch's `key_padding_mask` too: convert
those with `from_hide_mask` / `from_key_padding_mask`. Float masks are refused because they are
ambiguous (a 0/1 keep-mask, a 0/1 hide-mask or an additive bias?).

Legend: B batch, T_q query length, T_k key length, h heads.

Shapes a mask may have, for scores of shape (B, h, T_q, T_k) (or any leading dims `...`):
    (T_k,)             the same keys for every query
    (B, T_k)           padding: per sequence, the same for every query and head
    (T_q, T_k)         the same for every sequence (e.g. a causal mask)
    (B, T_q, T_k)      per sequence and query
    (B, h, T_q, T_k)   everything
Any dimension may be 1. Dimensions before the last two align with the scores' leading dimensions
from the left (batch first), so (B, T_q, T_k) means "the same for every head", as in Keras.
A 2-D mask is (B, T_k) or (T_q, T_k) by which size matches; when B == T_q it is ambiguous and refused.
"""

import keras
import numpy as np
from keras import ops

from attnkit._validation import ArgumentTypeError, dtype_name, positive_int

CONVENTION = (
    "attnkit masks are boolean with True (or a nonzero integer) = may attend, the convention of "
    "Keras, JAX, torch SDPA and Hugging Face's attention_mask. Build one with "
    "attnkit.padding_mask(token_ids) or attnkit.causal_mask(q_len, k_len); convert a seed-style "
    "1 = hide mask with attnkit.from_hide_mask(mask) and torch's key_padding_mask with "
    "attnkit.from_key_padding_mask(mask)"
)


class MaskDtypeError(ArgumentTypeError):
    """A mask of a dtype attnkit refuses (floats). Both a TypeError and a ValueError."""


def as_bool_mask(mask, name="mask"):
    """Returns `mask` as a boolean tensor; integers count as nonzero = attend, floats are refused.

    Raises:
        MaskDtypeError: `mask` is a float (or other non-bool, non-integer) array.
    """
    dtype = check_mask_dtype(mask, name)
    if dtype == "bool":
        return ops.convert_to_tensor(mask, dtype="bool")
    return ops.not_equal(ops.convert_to_tensor(mask), 0)


def check_mask_dtype(mask, name="mask"):
    """Returns the dtype name of `mask` if it is boolean or integer, else raises a MaskDtypeError.

    Runs before any conversion to a tensor, so that a string mask gets this message on every backend."""
    dtype = dtype_name(mask)
    if dtype != "bool" and "int" not in dtype:
        raise MaskDtypeError(
            f"`{name}` must be a boolean or integer mask, not {dtype}. {CONVENTION}. "
            f"Received: {name} with dtype={dtype}"
        )
    return dtype


def padding_mask(token_ids, pad_id=0):
    """Marks the real tokens of a batch of token ids.

    Args:
        token_ids: integer array (B, T) (or any shape).
        pad_id: the id of the padding token. Default 0.

    Returns:
        Boolean tensor of the same shape as `token_ids`: True at real tokens, False at padding.

    Example:
    >>> padding_mask([[5, 7, 0]])  # [[True, True, False]]
    """
    ids = ops.convert_to_tensor(token_ids)
    return ops.not_equal(ids, ops.cast(pad_id, ids.dtype))


def causal_mask(q_len, k_len=None):
    """The look-ahead mask, aligned bottom-right (cached decoding: docs/decisions.md items 7 and 34).

    Query i of `q_len` may attend to keys 0 .. (k_len - q_len + i). With q_len == k_len this is the
    usual lower-triangular mask; with q_len < k_len the queries are the *last* q_len positions, as in
    cached decoding. With q_len > k_len the first (q_len - k_len) queries see nothing (their
    attention output is zero).

    Args:
        q_len: number of queries T_q, a positive integer.
        k_len: number of keys T_k; defaults to `q_len`.

    Returns:
        Boolean tensor (T_q, T_k), True = may attend.

    Example:
    >>> causal_mask(2, 3)  # [[True, True, False], [True, True, True]]
    """
    q_len = positive_int("q_len", q_len)
    k_len = q_len if k_len is None else positive_int("k_len", k_len)
    rows = np.arange(q_len)[:, None] + (k_len - q_len)  # (T_q, 1)
    return ops.convert_to_tensor(np.arange(k_len)[None, :] <= rows)


def combine_masks(*masks):
    """Logical AND of masks, skipping `None`s; `None` when all are `None`.

    Masks combine by NumPy broadcasting, so give padding as (B, 1, T_k) when combining it with a
    (T_q, T_k) mask: `combine_masks(padding_mask(ids)[:, None, :], causal_mask(T))` is (B, T, T).
    """
    result = None
    for i, mask in enumerate(masks):
        if mask is None:
            continue
        mask = as_bool_mask(mask, name=f"masks[{i}]")
        result = mask if result is None else ops.logical_and(result, mask)
    return result


def _from_inverted(mask, name):
    dtype = dtype_name(mask)
    if dtype != "bool" and "int" not in dtype and "float" not in dtype:
        raise MaskDtypeError(
            f"`{name}` must be a boolean, integer or 0/1 float mask. Received: {name} with dtype={dtype}"
        )
    x = ops.convert_to_tensor(mask)
    if dtype == "bool":
        return ops.logical_not(x)
    if "float" in dtype:
        # The seeds build their masks as 0.0/1.0 floats; accept exactly those, nothing fractional.
        values = ops.convert_to_numpy(x)
        if not np.isin(values, (0.0, 1.0)).all():
            raise ValueError(
                f"`{name}` as a float must hold only 0.0 (keep) and 1.0 (hide). "
                f"Received values such as {values[~np.isin(values, (0.0, 1.0))].ravel()[:3].tolist()}"
            )
    return ops.equal(x, ops.cast(0, x.dtype))


def from_hide_mask(mask):
    """Converts a seed-style mask (1 = hide, 0 = keep; bool, int or 0/1 float) to attnkit's keep-mask."""
    return _from_inverted(mask, "mask")


def from_key_padding_mask(key_padding_mask):
    """Converts torch's `key_padding_mask` (B, T_k), True = ignore, to attnkit's (B, T_k) keep-mask."""
    return _from_inverted(key_padding_mask, "key_padding_mask")


def shape_str(shape):
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ")"


def _asserted_not_query_rows(mask, query_length, name):
    """A (B, T_k) mask traced with B unknown, asserted in a tensorflow graph to have a first dimension
    of 1 or other than T_q when it runs: else it could be a (T_q, T_k) mask read as padding."""
    if keras.backend.backend() != "tensorflow" or isinstance(mask, keras.KerasTensor):
        return mask  # jax traces known shapes; torch runs eagerly
    import tensorflow as tf
    from tensorflow.python.ops import control_flow_util

    if tf.executing_eagerly() or control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        return mask  # XLA would drop the assertion, with a warning at every compilation
    rows = tf.shape(mask)[0]
    ambiguous = tf.logical_and(tf.equal(rows, tf.cast(query_length, rows.dtype)), tf.not_equal(rows, 1))
    message = (f"`{name}` of shape (None, T_k), read as a (B, T_k) padding mask, has as many rows as there are "
               "queries, so it could be a (T_q, T_k) mask: pass a padding mask as (B, 1, T_k) (e.g. mask[:, None, :]) "
               "or a per-query mask as (1, T_q, T_k) (e.g. mask[None]); for look-ahead use causal=True. Rows:")
    with tf.control_dependencies([tf.debugging.Assert(tf.logical_not(ambiguous), [message, rows])]):
        return tf.identity(mask)


def broadcast_mask(mask, scores_shape, name="mask", query_length=None):
    """Validates `mask` and reshapes it to the rank of the scores so that it broadcasts.

    Args:
        mask: a keep-mask (bool or integer) of one of the shapes in the module docstring.
        scores_shape: static shape of the scores, (*lead, T_q, T_k); entries may be None.
        query_length: T_q as the running graph knows it (`ops.shape(queries)[-2]`), or None. A 2-D
            mask whose first dimension is unknown when traced is read as (B, T_k) padding; given
            this, a tensorflow graph asserts when it runs that the dimension is not T_q, the case
            the eager check refuses as ambiguous (XLA removes assertions).

    Returns:
        Boolean tensor of rank len(scores_shape) whose dims are 1 or equal to the scores'.

    Raises:
        MaskDtypeError: a float mask.
        ValueError: a mask that does not broadcast, naming both shapes.
    """
    mask = as_bool_mask(mask, name)
    shape = tuple(mask.shape)
    *lead, t_q, t_k = scores_shape
    rank = len(scores_shape)

    def fail(reason=""):
        raise ValueError(
            f"`{name}` of shape {shape_str(shape)} does not broadcast to the attention scores of "
            f"shape {shape_str(scores_shape)} (..., T_q, T_k){reason}. Accepted: (T_k,), (B, T_k), "
            f"(T_q, T_k), (B, T_q, T_k), (B, h, T_q, T_k), any dimension may be 1."
        )

    def fits(dim, size):
        return dim == 1 or dim is None or size is None or dim == size

    if len(shape) == 0 or len(shape) > rank or not fits(shape[-1], t_k):
        fail()
    if len(shape) == 1:
        for _ in range(rank - 1):
            mask = ops.expand_dims(mask, 0)  # (T_k,) -> (1, ..., 1, T_k)
        return mask
    if len(shape) == 2 and lead:
        d0, batch = shape[0], lead[0]
        is_batch = d0 is None or (batch is not None and d0 == batch)
        is_query = d0 is not None and (t_q is not None and d0 == t_q)
        if d0 == 1 or (is_query and not is_batch):
            for _ in range(rank - 2):
                mask = ops.expand_dims(mask, 0)  # (T_q, T_k) -> (1, ..., 1, T_q, T_k)
            return mask
        if is_batch and is_query:
            raise ValueError(
                f"`{name}` of shape {shape_str(shape)} is ambiguous: the batch size and the query "
                f"length are both {d0}. Pass a padding mask as (B, 1, T_k) (e.g. mask[:, None, :]) "
                f"or a per-query mask as (1, T_q, T_k) (e.g. mask[None]); for look-ahead use causal=True."
            )
        if not is_batch:
            fail()
        if d0 is None and query_length is not None:
            mask = _asserted_not_query_rows(mask, query_length, name)
        for _ in range(rank - 2):
            mask = ops.expand_dims(mask, 1)  # (B, T_k) -> (B, 1, ..., 1, T_k)
        return mask
    if not fits(shape[-2], t_q):
        fail()
    mask_lead = shape[:-2]
    for dim, size in zip(mask_lead, lead):
        if not fits(dim, size):
            fail()
    for _ in range(rank - len(shape)):
        mask = ops.expand_dims(mask, len(mask_lead))  # leading dims align left: insert after them
    return mask
