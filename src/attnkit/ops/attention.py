"""Scaled dot-product attention (Vaswani et al. 2017, section 3.2.1), explicit and fused.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

Legend: `...` any leading dims (batch, heads), T_q query length, T_k key/value length,
d_k query/key width, d_v value width.

Two paths give the same numbers (tested):
- `scaled_dot_product_attention` is explicit (matmul, softmax, matmul) and returns the weights too.
- `fused_attention` returns the output only and, when attention dropout is inactive, runs the
  backend's fused kernel (`_fused.py`), whose memory does not grow as T_q * T_k. Where the backend
  has no such kernel (tensorflow; jax on CPU, whose kernel materializes the scores), long sequences
  run the explicit computation one block of queries at a time (`_blocked`), so that at most
  (..., block, T_k) scores are alive at once.

The explicit path materializes the (..., T_q, T_k) scores: above a memory budget (2 GiB by default;
`set_max_scores_bytes`, or the environment variable ATTNKIT_MAX_SCORES_BYTES) it raises a
MemoryError before allocating them, instead of exhausting the machine's memory. The blocked path
keeps each block's scores within the budget too.

Rows with nothing to attend to give zero output and zero weights (DESIGN.md decision 5). The softmax
runs in float32 when the inputs are float16/bfloat16, and masked scores are filled with the smallest
finite value of that dtype, never a literal that overflows (decision 6).
"""

import math
import os

import keras
import numpy as np
from keras import ops

from attnkit._validation import positive_float, positive_int, rate
from attnkit.ops import _fused
from attnkit.ops.masks import _shape_str, broadcast_mask

HALF_DTYPES = ("float16", "bfloat16")
DEFAULT_MAX_SCORES_BYTES = 2 * 1024**3
# The blocked path (backends without a memory-efficient kernel) takes over when the scores would
# exceed BLOCKED_ABOVE_BYTES, with blocks of at most QUERY_BLOCK queries and BLOCKED_ABOVE_BYTES of
# scores. 128 queries measured fastest on jax and tensorflow at T = 4096 and 16384, h = 8 (16 to 512
# tried: smaller blocks under-use the GEMMs, larger ones fall out of the cache).
BLOCKED_ABOVE_BYTES = 64 * 1024**2
QUERY_BLOCK = 128
MAX_SCORES_ENV = "ATTNKIT_MAX_SCORES_BYTES"
_max_scores_bytes = None  # set by `set_max_scores_bytes`; None: the environment variable or the default


def set_max_scores_bytes(max_bytes):
    """Sets the largest scores tensor, in bytes, the explicit path may allocate; None restores the default.

    Args:
        max_bytes: a positive integer, or None for ATTNKIT_MAX_SCORES_BYTES if set, else 2 GiB.

    Raises:
        ValueError: `max_bytes` is not a positive integer.

    Example:
    >>> set_max_scores_bytes(8 * 1024**3)  # allow 8 GiB of scores
    """
    global _max_scores_bytes
    _max_scores_bytes = None if max_bytes is None else positive_int("max_bytes", max_bytes)


def max_scores_bytes():
    """The current budget in bytes: `set_max_scores_bytes`'s, else ATTNKIT_MAX_SCORES_BYTES, else 2 GiB."""
    if _max_scores_bytes is not None:
        return _max_scores_bytes
    value = os.environ.get(MAX_SCORES_ENV)
    if value is None or not value.strip():
        return DEFAULT_MAX_SCORES_BYTES
    try:
        return positive_int(MAX_SCORES_ENV, int(value))
    except ValueError:
        raise ValueError(
            f"The environment variable {MAX_SCORES_ENV} must be a positive integer (bytes). Received: {value!r}"
        ) from None


def _scores_dtype(dtype):
    """The scores' dtype: float32 for half-precision inputs (decision 5 in docs/decisions.md)."""
    return "float32" if dtype in HALF_DTYPES else dtype


def check_scores_budget(scores_shape, dtype):
    """Raises a MemoryError naming the size and the way out when a scores tensor would exceed the budget.

    Shapes with unknown (symbolic) dimensions pass: nothing is allocated for them.
    """
    if any(d is None for d in scores_shape):
        return
    size = math.prod(scores_shape) * np.dtype(dtype).itemsize
    budget = max_scores_bytes()
    if size > budget:
        raise MemoryError(
            f"Explicit attention would allocate a scores tensor of shape {_shape_str(scores_shape)} {dtype} "
            f"= {size / 1024**3:.2f} GiB, above the budget of {budget / 1024**3:.2f} GiB. Don't request the "
            "attention weights (use `fused_attention`, or return_attention_weights=False in the layers), whose "
            "memory does not grow as T_q * T_k; or shorten the sequences; or "
            f"raise the budget with attnkit.ops.set_max_scores_bytes(...) or {MAX_SCORES_ENV}."
        )


def query_block_size(scores_shape, dtype):
    """Queries per block for the blocked path, or None when the whole (..., T_q, T_k) scores fit one block.

    Args:
        scores_shape: (*lead, T_q, T_k). Unknown (None) lead dimensions, such as the batch of a
            `tf.function` traced for any batch size, count as 1: the blocks are then sized for one
            example, and the single-query check below cannot be made. Unknown T_q or T_k give None.
        dtype: the inputs' dtype name.

    Raises:
        MemoryError: a single query's scores (*lead, 1, T_k) exceed the budget.
    """
    *lead, q_len, k_len = scores_shape
    if q_len is None or k_len is None:
        return None
    unknown_lead = sum(d is None for d in lead)
    if unknown_lead > 1:
        return None  # a reshape can infer one dimension only
    row_bytes = math.prod(d or 1 for d in lead) * k_len * np.dtype(_scores_dtype(dtype)).itemsize  # one query's scores
    block_bytes = min(BLOCKED_ABOVE_BYTES, max_scores_bytes())
    if q_len * row_bytes <= block_bytes:
        return None
    if not unknown_lead:
        check_scores_budget((*lead, 1, k_len), _scores_dtype(dtype))
    return max(1, min(QUERY_BLOCK, block_bytes // row_bytes))


def check_qkv(queries, keys, values):
    """Raises a clear ValueError unless q (..., T_q, d_k), k (..., T_k, d_k), v (..., T_k, d_v) agree."""
    q, k, v = (tuple(x.shape) for x in (queries, keys, values))
    for name, shape in (("queries", q), ("keys", k), ("values", v)):
        if len(shape) < 3:
            raise ValueError(
                f"`{name}` must have rank >= 3, (batch, ..., length, features). "
                f"Received: {name}.shape={_shape_str(shape)}"
            )
    if not (len(q) == len(k) == len(v)):
        raise ValueError(
            "`queries`, `keys` and `values` must have the same rank. Received shapes: "
            f"queries={_shape_str(q)}, keys={_shape_str(k)}, values={_shape_str(v)}"
        )
    for a, b, c in zip(q[:-2], k[:-2], v[:-2]):
        if len({d for d in (a, b, c) if d is not None}) > 1:
            raise ValueError(
                "`queries`, `keys` and `values` must have the same batch dimensions. Received "
                f"shapes: queries={_shape_str(q)}, keys={_shape_str(k)}, values={_shape_str(v)}"
            )
    if None not in (k[-2], v[-2]) and k[-2] != v[-2]:
        raise ValueError(
            "`keys` and `values` must have the same length T_k. Received shapes: "
            f"keys={_shape_str(k)}, values={_shape_str(v)}"
        )
    if None not in (q[-1], k[-1]) and q[-1] != k[-1]:
        raise ValueError(
            "`queries` and `keys` must have the same width d_k. Received shapes: "
            f"queries={_shape_str(q)}, keys={_shape_str(k)}"
        )


def default_scale(queries, scale):
    """`scale` validated, or 1/sqrt(d_k) from the queries' last dimension."""
    if scale is None:
        return 1.0 / math.sqrt(queries.shape[-1])
    return positive_float("scale", scale)


def causal_keep(q_len, k_len):
    """Bottom-right aligned look-ahead mask (T_q, T_k) from possibly dynamic lengths."""
    rows = ops.expand_dims(ops.arange(q_len), 1) + (k_len - q_len)  # (T_q, 1)
    return ops.expand_dims(ops.arange(k_len), 0) <= rows  # (T_q, T_k)


def keep_mask(mask, causal, scores_shape, dynamic_lengths):
    """The combined keep-mask broadcastable to the scores, or None when everything is kept."""
    keep = None if mask is None else broadcast_mask(mask, scores_shape)
    if causal:
        look_ahead = causal_keep(*dynamic_lengths)
        keep = look_ahead if keep is None else ops.logical_and(keep, look_ahead)
    return keep


def masked_softmax(scores, keep=None):
    """Softmax over the last axis where `keep` is True; rows with nothing kept are all zeros.

    Args:
        scores: (..., T_q, T_k) logits.
        keep: None or a boolean mask broadcastable to `scores`.

    Returns:
        Weights of the dtype of `scores`, computed in float32 when `scores` is float16/bfloat16.
    """
    dtype = keras.backend.standardize_dtype(scores.dtype)
    softmax_dtype = "float32" if dtype in HALF_DTYPES else dtype
    scores = ops.cast(scores, softmax_dtype)
    if keep is not None:
        scores = ops.where(keep, scores, ops.cast(float(np.finfo(softmax_dtype).min), softmax_dtype))
    weights = ops.softmax(scores, axis=-1)
    if keep is not None:
        # Exact zeros where masked; a row with no key left is all zeros instead of uniform.
        weights = ops.where(keep, weights, ops.zeros((), softmax_dtype))
    return ops.cast(weights, dtype)


def scaled_dot_product_attention(
    queries, keys, values, mask=None, *, causal=False, scale=None, dropout=0.0, training=False, seed=None
):
    """Scaled dot-product attention, explicit path: returns the output and the weights.

    Args:
        queries: (..., T_q, d_k).
        keys: (..., T_k, d_k).
        values: (..., T_k, d_v).
        mask: optional keep-mask, True = may attend (see `attnkit.ops.masks` for the shapes).
        causal: also apply the bottom-right look-ahead mask. Default False.
        scale: multiplies the scores; default 1/sqrt(d_k). Must be finite and > 0.
        dropout: dropout rate on the weights, in [0, 1), active only when `training`.
        training: whether dropout is active.
        seed: int or `keras.random.SeedGenerator` for the dropout.

    Returns:
        (output, weights): output (..., T_q, d_v) and weights (..., T_q, T_k), the softmax
        probabilities before dropout. Rows with nothing to attend to are zero in both.

    Raises:
        ValueError: ranks below 3, mismatched shapes, a mask that does not broadcast, a bad scale
            or dropout rate.
        TypeError: a float mask.
        MemoryError: the scores (..., T_q, T_k) would exceed `max_scores_bytes()`.

    Example:
    >>> q = k = v = keras.random.normal((2, 5, 8))
    >>> out, w = scaled_dot_product_attention(q, k, v, causal=True)  # (2, 5, 8), (2, 5, 5)
    """
    queries, keys, values = (ops.convert_to_tensor(x) for x in (queries, keys, values))
    check_qkv(queries, keys, values)
    scale = default_scale(queries, scale)
    dropout = rate("dropout", dropout)
    return _explicit(queries, keys, values, mask, causal, scale, dropout, training, seed)


def fused_attention(
    queries, keys, values, mask=None, *, causal=False, scale=None, dropout=0.0, training=False, seed=None
):
    """Scaled dot-product attention, output only: the backend's fused kernel when dropout is inactive.

    Same arguments and numbers as `scaled_dot_product_attention`; returns the output (..., T_q, d_v).
    On torch this is `torch.nn.functional.scaled_dot_product_attention` (its CPU flash kernel), on
    jax `jax.nn.dot_product_attention`, on tensorflow the explicit path. Where the backend's path
    would materialize the scores (tensorflow, jax on CPU) and they exceed
    min(BLOCKED_ABOVE_BYTES, max_scores_bytes()), the queries run in blocks instead, each with its
    exact softmax: memory grows as T_k, not T_q * T_k. A MemoryError is raised only when a single
    query's scores (..., 1, T_k) exceed the budget.
    """
    queries, keys, values = (ops.convert_to_tensor(x) for x in (queries, keys, values))
    check_qkv(queries, keys, values)
    scale = default_scale(queries, scale)
    dropout = rate("dropout", dropout)
    if dropout > 0 and training:
        return _explicit(queries, keys, values, mask, causal, scale, dropout, training, seed)[0]
    scores_shape = (*queries.shape[:-1], keys.shape[-2])
    if not _fused.memory_efficient() and not isinstance(queries, keras.KerasTensor):
        block = query_block_size(scores_shape, keras.backend.standardize_dtype(queries.dtype))
        if block is not None:
            keep = None if mask is None else broadcast_mask(mask, scores_shape)
            return _blocked(queries, keys, values, keep, causal, scale, block)
    lengths = (ops.shape(queries)[-2], ops.shape(keys)[-2])
    q_len, k_len = queries.shape[-2], keys.shape[-2]
    if causal and mask is None and q_len is not None and q_len == k_len:
        # Square causal alone: the kernels' own flag is the same mask and needs no (T, T) tensor.
        keep, fused_causal = None, True
    else:
        keep, fused_causal = keep_mask(mask, causal, scores_shape, lengths), False
    output = _fused.attention(queries, keys, values, keep, fused_causal, scale)
    if output is None:
        return _explicit(queries, keys, values, mask, causal, scale, 0.0, False, None)[0]
    return output


def _explicit(queries, keys, values, mask, causal, scale, dropout, training, seed):
    dtype = keras.backend.standardize_dtype(queries.dtype)
    check_scores_budget((*queries.shape[:-1], keys.shape[-2]), _scores_dtype(dtype))
    scores = _scores(queries, keys, scale)  # (..., T_q, T_k)
    lengths = (ops.shape(queries)[-2], ops.shape(keys)[-2])
    keep = keep_mask(mask, causal, tuple(scores.shape), lengths)
    weights = ops.cast(masked_softmax(scores, keep), dtype)
    attended = weights
    if training and dropout > 0:
        attended = keras.random.dropout(weights, dropout, seed=seed)
    return ops.matmul(attended, values), weights  # (..., T_q, d_v), (..., T_q, T_k)


def _scores(queries, keys, scale):
    """scale * Q K^T, (..., T_q, T_k), in float32 for half-precision inputs."""
    # float16 scores overflow (max 65504) once |q . k| * scale is large, e.g. inputs of 100 with
    # d_k = 64: compute them in float32, where the softmax runs anyway, as the fused kernels do.
    score_dtype = _scores_dtype(keras.backend.standardize_dtype(queries.dtype))
    # Scale the queries, not the scores: fewer multiplications.
    scaled_queries = ops.cast(queries, score_dtype) * ops.cast(scale, score_dtype)
    return ops.matmul(scaled_queries, ops.swapaxes(ops.cast(keys, score_dtype), -1, -2))


def _blocked(queries, keys, values, keep, causal, scale, block):
    """The explicit computation, `block` queries at a time; output (..., T_q, d_v) only.

    Every query's softmax lies inside its block, so the result is the explicit path's. `keras.ops.map`
    runs the blocks in sequence (`lax.map` on jax, `tf.map_fn` on tensorflow), so only one block's
    (..., block, T_k) scores are alive at once; `keras.remat` recomputes them in the backward pass
    instead of keeping every block's softmax for it.

    Args:
        queries, keys, values: (*lead, T_q, d_k), (*lead, T_k, d_k), (*lead, T_k, d_v); static shapes
            but for at most one unknown lead dimension (a traced batch).
        keep: None or a boolean keep-mask of the scores' rank (`broadcast_mask`), without the look-ahead.
        causal: apply the bottom-right look-ahead mask, block by block.
        scale: float.
        block: queries per block, from `query_block_size`.
    """
    dtype = keras.backend.standardize_dtype(queries.dtype)
    *lead, q_len, _ = queries.shape
    k_len = keys.shape[-2]
    n = -(-q_len // block)
    pad = n * block - q_len  # padded query rows attend like any other and are dropped at the end

    def known(shape):
        # A traced batch of unknown size (tf.function) is the one dimension reshape may infer.
        return tuple(-1 if d is None else d for d in shape)

    def to_blocks(x, fill):
        # (*lead, T_q, d) -> (n, *lead, block, d): block i is queries i*block .. (i+1)*block - 1.
        x = ops.pad(x, [(0, 0)] * (len(x.shape) - 2) + [(0, pad), (0, 0)], constant_values=fill)
        x = ops.reshape(x, known((*x.shape[:-2], n, block, x.shape[-1])))
        return ops.moveaxis(x, -3, 0)

    blocks = {"queries": to_blocks(queries, 0), "start": ops.arange(0, n * block, block, dtype="int32")}
    per_query_keep = keep is not None and keep.shape[-2] != 1
    if per_query_keep:
        blocks["keep"] = to_blocks(keep, True)  # (n, *lead|1, block, T_k)

    def attend(b):
        block_keep = b["keep"] if per_query_keep else keep
        if causal:
            rows = b["start"] + ops.arange(block, dtype="int32") + (k_len - q_len)  # (block,)
            look_ahead = ops.arange(k_len, dtype="int32")[None, :] <= rows[:, None]  # (block, T_k)
            block_keep = look_ahead if block_keep is None else ops.logical_and(block_keep, look_ahead)

        # The differentiable inputs are arguments, not closures: tensorflow's recompute_grad only
        # differentiates with respect to its arguments.
        @keras.remat
        def block_output(q, k, v):
            weights = ops.cast(masked_softmax(_scores(q, k, scale), block_keep), dtype)  # (*lead, block, T_k)
            return ops.matmul(weights, v)  # (*lead, block, d_v)

        return block_output(b["queries"], keys, values)

    out = ops.map(attend, blocks)  # (n, *lead, block, d_v)
    out = ops.moveaxis(out, 0, -3)  # (*lead, n, block, d_v)
    out = ops.reshape(out, known((*lead, n * block, values.shape[-1])))
    return out[..., :q_len, :]  # (*lead, T_q, d_v)
