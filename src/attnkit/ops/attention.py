"""Scaled dot-product attention (Vaswani et al. 2017, section 3.2.1), explicit and fused.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V

Legend: `...` any leading dims (batch, heads), T_q query length, T_k key/value length,
d_k query/key width, d_v value width.

Two paths give the same numbers (tested):
- `scaled_dot_product_attention` is explicit (matmul, softmax, matmul) and returns the weights too.
- `fused_attention` returns the output only and, when attention dropout is inactive, runs the
  backend's fused kernel (`attnkit.kernels`), whose memory does not grow as T_q * T_k. Where the backend
  has no such kernel (tensorflow; jax on CPU, whose kernel materializes the scores), long sequences
  run tile by tile with an online softmax (`tiled.py`), so that only a few (..., bq, bk) tiles of
  scores are alive at once.

The explicit path materializes the (..., T_q, T_k) scores: above a memory budget (2 GiB by default;
`set_max_scores_bytes`, or the environment variable ATTNKIT_MAX_SCORES_BYTES) it raises a
MemoryError before allocating them, instead of exhausting the machine's memory. The tiled path
keeps each tile within the budget too.

Rows with nothing to attend to give zero output and zero weights (docs/decisions.md item 14). The softmax
runs in float32 when the inputs are float16/bfloat16, and masked scores are filled with the smallest
finite value of that dtype, never a literal that overflows (docs/decisions.md items 5 and 17).
"""

import math
import os

import keras
import numpy as np
from keras import ops

from attnkit._validation import ArgumentTypeError, boolean, floating, positive_float, positive_int, rate
from attnkit import kernels
from attnkit.kernels import tiled
from attnkit.kernels.numerics import HALF_DTYPES, constant, scores_dtype
from attnkit.ops.masks import shape_str, broadcast_mask

DEFAULT_MAX_SCORES_BYTES = 2 * 1024**3
# Without a memory-efficient kernel, `fused_attention` computes the scores tile by tile (`tiled.py`)
# once the whole scores would exceed TILED_ABOVE_BYTES (or the budget, if lower).
TILED_ABOVE_BYTES = 64 * 1024**2
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
            f"Explicit attention would allocate a scores tensor of shape {shape_str(scores_shape)} {dtype} "
            f"= {_bytes_str(size)}, above the budget of {_bytes_str(budget)}. Don't request the "
            "attention weights (use `fused_attention`, or return_attention_weights=False in the layers), whose "
            "memory does not grow as T_q * T_k; or shorten the sequences; or "
            f"raise the budget with attnkit.ops.set_max_scores_bytes(...) or {MAX_SCORES_ENV}."
        )


def _bytes_str(size):
    """`size` bytes in the largest binary unit that keeps it at least 1: '8.00 GiB', '504 bytes'."""
    for unit, power in (("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if size >= 1024**power:
            return f"{size / 1024**power:.2f} {unit}"
    return f"{size} bytes"


def tile_for(scores_shape, dtype):
    """The (examples, bq, bk) tile `fused_attention` computes the scores in when the backend has no
    memory-efficient kernel, or None when the whole (*lead, T_q, T_k) scores are small enough.

    Args:
        scores_shape: (*lead, T_q, T_k). Unknown (None) lead dimensions, such as the batch of a
            `tf.function` traced for any batch size, count as 1: the tiles then hold one example.
            Unknown T_q or T_k, or more than one unknown lead dimension, give None.
        dtype: the inputs' dtype name.
    """
    *lead, q_len, k_len = scores_shape
    if q_len is None or k_len is None or sum(d is None for d in lead) > 1:
        return None  # tiles need static lengths, and a reshape can infer one dimension only
    score_dtype = scores_dtype(dtype)
    size = math.prod(d or 1 for d in lead) * q_len * k_len * np.dtype(score_dtype).itemsize
    if size <= min(TILED_ABOVE_BYTES, max_scores_bytes()):
        return None
    return tiled.tile_shape(scores_shape, score_dtype, min(tiled.TILE_BYTES, max_scores_bytes()))


def checked_tensors(queries, keys, values):
    """The three inputs as backend tensors, once their dtypes (floating, one dtype: `check_dtypes`) and
    shapes (`check_qkv`) are checked: before any kernel runs, on every backend."""
    check_dtypes(queries, keys, values)  # before the conversion, which fails on strings with each backend's own message
    queries, keys, values = (ops.convert_to_tensor(x) for x in (queries, keys, values))
    check_qkv(queries, keys, values)
    return queries, keys, values


def check_dtypes(queries, keys, values):
    """Raises an ArgumentTypeError unless q, k and v are floating-point of one dtype (docs/decisions.md
    item 114): the backends disagree on mixed ones (torch's kernels refuse them with their own error,
    the explicit path promotes or demotes: a float64 q met float32 k/v in float32), so none is picked."""
    dtypes = [floating(name, x) for name, x in (("queries", queries), ("keys", keys), ("values", values))]
    if len(set(dtypes)) > 1:
        raise ArgumentTypeError(
            "`queries`, `keys` and `values` must have the same floating-point dtype (cast them first). Received: "
            f"queries.dtype={dtypes[0]}, keys.dtype={dtypes[1]}, values.dtype={dtypes[2]}"
        )


def check_qkv(queries, keys, values):
    """Raises a clear ValueError unless q (..., T_q, d_k), k (..., T_k, d_k), v (..., T_k, d_v) agree."""
    q, k, v = (tuple(x.shape) for x in (queries, keys, values))
    for name, shape in (("queries", q), ("keys", k), ("values", v)):
        if len(shape) < 3:
            raise ValueError(
                f"`{name}` must have rank >= 3, (batch, ..., length, features). "
                f"Received: {name}.shape={shape_str(shape)}"
            )
    if not (len(q) == len(k) == len(v)):
        raise ValueError(
            "`queries`, `keys` and `values` must have the same rank. Received shapes: "
            f"queries={shape_str(q)}, keys={shape_str(k)}, values={shape_str(v)}"
        )
    for a, b, c in zip(q[:-2], k[:-2], v[:-2]):
        if len({d for d in (a, b, c) if d is not None}) > 1:
            raise ValueError(
                "`queries`, `keys` and `values` must have the same batch dimensions. Received "
                f"shapes: queries={shape_str(q)}, keys={shape_str(k)}, values={shape_str(v)}"
            )
    if None not in (k[-2], v[-2]) and k[-2] != v[-2]:
        raise ValueError(
            "`keys` and `values` must have the same length T_k. Received shapes: "
            f"keys={shape_str(k)}, values={shape_str(v)}"
        )
    if None not in (q[-1], k[-1]) and q[-1] != k[-1]:
        raise ValueError(
            "`queries` and `keys` must have the same width d_k. Received shapes: "
            f"queries={shape_str(q)}, keys={shape_str(k)}"
        )
    check_widths(queries, keys, values)


def check_widths(queries, keys, values):
    """Raises a ValueError if a width (d_k, d_v) is 0."""
    for name, x, width in (("queries", queries, "d_k"), ("keys", keys, "d_k"), ("values", values, "d_v")):
        shape = tuple(x.shape)
        # No score over zero features (1/sqrt(0)); lengths of 0 are exact (docs/decisions.md item 114).
        if shape and shape[-1] == 0:
            raise ValueError(
                f"`{name}` must have a positive width {width} (its last dimension). "
                f"Received: {name}.shape={shape_str(shape)}"
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
    keep = None if mask is None else broadcast_mask(mask, scores_shape, query_length=dynamic_lengths[0])
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
    return _masked_softmax(scores, keep, for_output_only=False)


def _masked_softmax(scores, keep, for_output_only):
    """`masked_softmax`; `for_output_only` where only the product of the weights with the values is
    read (`fused_attention`): masked weights are then zeroed by multiplying with the mask.

    The product is the same bit for bit: the two differ only where a masked weight is NaN, which
    happens only when the row's sum is NaN, and then every kept weight, so the row's output, is NaN
    too. Under XLA on the CPU the select after the softmax ran the attention 2-4x slower than the
    multiplication (docs/decisions.md item 74); its gradient is still the select's
    (`kernels.times_mask`), and the weights `scaled_dot_product_attention` returns keep their exact
    zeros.
    """
    dtype = keras.backend.standardize_dtype(scores.dtype)
    softmax_dtype = scores_dtype(dtype)
    scores = ops.cast(scores, softmax_dtype)
    if keep is not None:
        # Masked scores are -inf, so a row whose kept scores are all -inf is NaN (0 / 0), as it is
        # unmasked; a row with no key kept gets the lowest finite score instead, a finite (uniform)
        # softmax that the mask then zeroes. torch's batched GEMMs (`kernels.attention`) and `tiled`
        # give the same numbers.
        has_key = ops.any(keep, axis=-1, keepdims=True)  # (..., T_q|1, 1)
        fill = ops.where(has_key, constant(-np.inf, softmax_dtype), constant(np.finfo(softmax_dtype).min, softmax_dtype))
        scores = ops.where(keep, scores, fill)
    if scores.shape[-1] == 1:
        # One key: weight 1, without Keras's warning about such softmaxes; exp(s - s) keeps a NaN or an
        # infinite score NaN, as the softmax would, where a literal 1 would hide it.
        weights = ops.exp(scores - scores)
    else:
        weights = ops.softmax(scores, axis=-1)
    if keep is not None and for_output_only:
        weights = kernels.times_mask(weights, keep)
    elif keep is not None:
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
        TypeError: queries, keys or values not floating-point; a mask neither boolean nor integer;
            `causal` or `training` not a bool.
        MemoryError: the scores (..., T_q, T_k) would exceed `max_scores_bytes()`.

    Example:
    >>> q = k = v = keras.random.normal((2, 5, 8))
    >>> out, w = scaled_dot_product_attention(q, k, v, causal=True)  # (2, 5, 8), (2, 5, 5)
    """
    queries, keys, values = checked_tensors(queries, keys, values)
    causal, training = boolean("causal", causal), boolean("training", training)
    scale = default_scale(queries, scale)
    dropout = rate("dropout", dropout)
    return _explicit(queries, keys, values, mask, causal, scale, dropout, training, seed)


def fused_attention(
    queries, keys, values, mask=None, *, causal=False, scale=None, dropout=0.0, training=False, seed=None
):
    """Scaled dot-product attention, output only: the backend's fused kernel when dropout is inactive.

    Same arguments and numbers as `scaled_dot_product_attention`; returns the output (..., T_q, d_v).
    On torch this is `torch.nn.functional.scaled_dot_product_attention` (its CPU flash kernel), on
    jax's accelerators `jax.nn.dot_product_attention`, elsewhere the explicit path. Where that path
    would materialize scores above min(TILED_ABOVE_BYTES, max_scores_bytes()) (tensorflow, jax on
    CPU), they are computed a tile at a time instead, with an online softmax and a written-out
    gradient (`tiled.py`): memory grows as T_q + T_k, not T_q * T_k, and nothing is refused.
    """
    queries, keys, values = checked_tensors(queries, keys, values)
    causal, training = boolean("causal", causal), boolean("training", training)
    scale = default_scale(queries, scale)
    dropout = rate("dropout", dropout)
    if dropout > 0 and training:
        return _explicit(queries, keys, values, mask, causal, scale, dropout, training, seed)[0]
    if not kernels.has_kernel(queries, values):
        output = _in_tiles(queries, keys, values, mask, causal, scale)
        if output is not None:
            return output
    scores_shape = (*queries.shape[:-1], keys.shape[-2])
    lengths = (ops.shape(queries)[-2], ops.shape(keys)[-2])
    q_len, k_len = queries.shape[-2], keys.shape[-2]
    if causal and mask is None and q_len is not None and q_len == k_len:
        # Square causal alone: the kernels' own flag is the same mask and needs no (T, T) tensor.
        keep, fused_causal = None, True
    else:
        keep, fused_causal = keep_mask(mask, causal, scores_shape, lengths), False
    output = kernels.attention(queries, keys, values, keep, fused_causal, scale)

    def without_kernel():  # tiles if the scores would be large, else the explicit path
        tiled = _in_tiles(queries, keys, values, mask, causal, scale)
        return tiled if tiled is not None else _explicit(queries, keys, values, mask, causal, scale, 0.0, False, None, output_only=True)[0]

    if output is None:  # no kernel took the inputs (on torch: NaN or Inf in them)
        return without_kernel()
    if keras.backend.backend() == "jax":
        # jax's kernels fill masked scores with a large finite number, so a row whose kept scores are
        # all -inf averages the masked values instead of giving NaN: inputs that are not all finite
        # take the other path, as torch's do (`kernels.all_finite`).
        output = kernels.if_finite((queries, keys, values), output, without_kernel)
    return output


def _in_tiles(queries, keys, values, mask, causal, scale):
    """The tiled output where the explicit path would materialize scores above `tile_for`'s size, else None."""
    if isinstance(queries, keras.KerasTensor):
        return None
    scores_shape = (*queries.shape[:-1], keys.shape[-2])
    tile = tile_for(scores_shape, keras.backend.standardize_dtype(queries.dtype))
    if tile is None:
        return None
    keep = None if mask is None else broadcast_mask(mask, scores_shape)
    return tiled.tiled_attention(queries, keys, values, keep, causal, scale, tile)


def _explicit(queries, keys, values, mask, causal, scale, dropout, training, seed, output_only=False):
    """(output, weights) by the explicit path; with `output_only` (no dropout) the weights are only
    good for the output (`_masked_softmax`)."""
    dtype = keras.backend.standardize_dtype(queries.dtype)
    check_scores_budget((*queries.shape[:-1], keys.shape[-2]), scores_dtype(dtype))
    scores = _scores(queries, keys, scale)  # (..., T_q, T_k)
    lengths = (ops.shape(queries)[-2], ops.shape(keys)[-2])
    keep = keep_mask(mask, causal, tuple(scores.shape), lengths)
    weights = ops.cast(_masked_softmax(scores, keep, for_output_only=output_only and not (training and dropout > 0)), dtype)
    attended = weights
    if training and dropout > 0:
        attended = keras.random.dropout(weights, dropout, seed=seed)
    return kernels.matmul(attended, values), weights  # (..., T_q, d_v), (..., T_q, T_k)


def _scores(queries, keys, scale):
    """scale * Q K^T, (..., T_q, T_k), in float32 for half-precision inputs."""
    # float16 scores overflow (max 65504) once |q . k| * scale is large, e.g. inputs of 100 with
    # d_k = 64: compute them in float32, where the softmax runs anyway, as the fused kernels do.
    score_dtype = scores_dtype(keras.backend.standardize_dtype(queries.dtype))
    if kernels.jax_bfloat16(queries, keys):
        # XLA multiplies the bfloat16 factors exactly into float32 products, 2.5x faster than
        # float32 factors; the scale then multiplies the float32 scores.
        scores = kernels.times_keys(queries, keys, float32_products=True)
        return scores * constant(scale, score_dtype)
    # Scale the queries, not the scores: fewer multiplications.
    scaled_queries = ops.cast(queries, score_dtype) * constant(scale, score_dtype)
    return kernels.times_keys(scaled_queries, ops.cast(keys, score_dtype))
