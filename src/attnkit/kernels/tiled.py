"""Tiled attention: the fused path for backends without a memory-efficient kernel (tensorflow, and jax
on CPU, whose kernel is XLA's matmul-softmax-matmul), in `keras.ops` (docs/decisions.md
item 12).

The scores are computed one tile at a time (a few examples, every head, bq queries, bk keys), with
the running ("online") softmax of FlashAttention (Dao et al. 2022): each query block keeps its output
o, its softmax denominator l and its running maximum m, and rescales them when a later key block
raises the maximum. Only a few tiles are alive at once, so memory grows as T_q + T_k, never as
T_q * T_k, and each tile stays in the cache, which measured faster than blocks of whole score rows
on jax and tensorflow (docs/performance.md, "Measurements behind the code").

The gradient is written out (`keras.ops.custom_gradient`, `jax.custom_vjp`) instead of
differentiating the loops, which would keep every tile's softmax: the forward pass saves only its
output and the log-sum-exp of each row, L = m + log(l), and the backward pass recomputes each tile's
weights P = exp(S - L) once, in one sweep over key blocks (FlashAttention-2's order): each key block
sums its dK and dV over the query blocks, and adds each tile's share of dQ into a whole dQ, in place
under XLA's while loops. Two sweeps (dQ over query blocks, then dK and dV over key blocks) recompute
every tile twice, and measured slower on jax and tensorflow:

    D = rowsum(dO * O),  dS = P * (dO V^T - D),  dQ = scale * dS K,  dK = dS^T (scale * Q),  dV = P^T dO

Rows with nothing to attend to (masked, or causal with T_q > T_k) keep l = 0: their output, weights and
gradients are exactly zero (docs/decisions.md item 14). Under a causal mask the tiles above the diagonal are skipped.

Legend: B batch, `lead` the leading dims of the examples in one tile (examples, *heads), T_q/T_k
lengths, d_k/d_v widths, n/m the numbers of query/key blocks, bq/bk their sizes.
"""

import math

import keras
import numpy as np
from keras import ops

from attnkit.kernels.numerics import constant, scores_dtype

# A tile of about 4 MiB of float32 scores, and large batches a few examples at a time: the sizes that
# measured fastest (docs/performance.md, "Measurements behind the code").
TILE_BYTES = 4 * 1024**2
KEY_BLOCK = 256
MAX_QUERY_BLOCK = 1024


def tile_shape(scores_shape, score_dtype, max_tile_bytes=TILE_BYTES):
    """(examples, bq, bk): the tile for scores of `scores_shape` (B, *heads, T_q, T_k) in `score_dtype`.

    A tile holds the scores of `examples` examples (a divisor of B), every head, bq queries and bk
    keys: at most `max_tile_bytes`, down to a single score per head. Unknown (None) dimensions among
    B and the heads, such as the batch of a `tf.function` traced for any batch size, count as 1,
    and the tile then holds one example.
    """
    batch, *heads, q_len, k_len = scores_shape
    item = np.dtype(score_dtype).itemsize
    example_bytes = math.prod(d or 1 for d in heads) * item  # one score of every head
    bk = max(1, min(KEY_BLOCK, k_len, max_tile_bytes // example_bytes))
    bq = max(1, min(MAX_QUERY_BLOCK, q_len, max_tile_bytes // (example_bytes * bk)))
    most = max(1, max_tile_bytes // (example_bytes * bq * bk))
    if batch is None or None in heads:
        return 1, bq, bk
    return max(d for d in range(1, min(most, batch) + 1) if batch % d == 0), bq, bk


def tiled_attention(queries, keys, values, keep, causal, scale, tile):
    """softmax(scale * Q K^T, masked) V, one tile of scores at a time, with its gradient.

    Args:
        queries, keys, values: (B, *heads, T_q, d_k), (B, *heads, T_k, d_k), (B, *heads, T_k, d_v);
            static T_q, T_k and widths, and at most one unknown dimension before them (a traced batch).
        keep: None or a boolean keep-mask of the scores' rank (`broadcast_mask`), without the look-ahead.
        causal: also apply the bottom-right look-ahead mask.
        scale: float.
        tile: (examples, bq, bk), from `tile_shape`.

    Returns:
        (B, *heads, T_q, d_v), in the queries' dtype; the scores and sums run in float32 for half inputs.
    """
    examples, *block = tile
    batch = queries.shape[0]
    if examples == batch:
        return _tiled_examples(queries, keys, values, keep, causal, scale, block)
    # A few examples at a time, in sequence.
    count = None if batch is None else batch // examples

    def chunk(x):  # (B, ...) -> (B / examples, examples, ...)
        return ops.reshape(x, _known((count, examples, *x.shape[1:])))

    chunks = {"q": chunk(queries), "k": chunk(keys), "v": chunk(values)}
    per_example_keep = keep is not None and keep.shape[0] != 1
    if per_example_keep:
        chunks["keep"] = chunk(keep)

    def attend(chunk):
        chunk_keep = chunk["keep"] if per_example_keep else keep
        return _tiled_examples(chunk["q"], chunk["k"], chunk["v"], chunk_keep, causal, scale, block)

    out = ops.map(attend, chunks)  # (B / examples, examples, *heads, T_q, d_v)
    return ops.reshape(out, _known((batch, *out.shape[2:])))


def _tiled_examples(queries, keys, values, keep, causal, scale, tile):
    """`tiled_attention` of all the examples given at once, in tiles (bq, bk) = `tile`."""
    dtype = keras.backend.standardize_dtype(queries.dtype)
    compute = scores_dtype(dtype)
    tiles = _Tiles(tuple(queries.shape), tuple(keys.shape), values.shape[-1], causal, tile, compute)

    def forward(q, k, v, keep):
        q_s = tiles.query_blocks(ops.cast(q, compute) * constant(scale, compute))  # (n, *lead, bq, d_k)
        k_b = tiles.key_blocks(ops.cast(k, compute))  # (m, *lead, bk, d_k)
        v_b = tiles.key_blocks(ops.cast(v, compute))  # (m, *lead, bk, d_v)
        o_b, lse_b = tiles.forward(q_s, k_b, v_b, keep)  # (n, *lead, bq, d_v), (n, *lead, bq)
        return ops.cast(tiles.from_query_blocks(o_b), dtype), (q_s, k_b, v_b, keep, o_b, lse_b)

    def backward(saved, d_o):
        d_q, d_k, d_v = tiles.backward(*saved, tiles.query_blocks(ops.cast(d_o, compute)))
        return (
            ops.cast(tiles.from_query_blocks(d_q) * constant(scale, compute), dtype),
            ops.cast(tiles.from_key_blocks(d_k), dtype),
            ops.cast(tiles.from_key_blocks(d_v), dtype),
        )

    keep = None if keep is None else tiles.mask_tiles(keep)
    return _with_gradient(forward, backward)(queries, keys, values, keep)


def _with_gradient(forward, backward):
    """f(q, k, v, keep): forward(q, k, v, keep)[0], whose gradient with respect to q, k and v is
    backward(saved, d_output), `saved` being forward(...)[1]; `keep` gets none."""
    if keras.backend.backend() == "jax":
        # jax.custom_gradient (keras.ops.custom_gradient) cannot close over the traced mask: custom_vjp
        # takes it as an argument.
        import jax

        @jax.custom_vjp
        def f(q, k, v, keep):
            return forward(q, k, v, keep)[0]

        f.defvjp(forward, lambda saved, d_o: (*backward(saved, d_o), None))
        return f

    def f(q, k, v, keep):
        @ops.custom_gradient
        def attend(q, k, v):
            out, saved = forward(q, k, v, keep)

            def gradient(*args, upstream=None):
                # tensorflow passes the output's gradient alone; torch the inputs, then `upstream`.
                return backward(saved, args[-1] if upstream is None else upstream)

            return out, gradient

        return attend(q, k, v)

    return f


class _Tiles:
    """The blocking of one attention call: padding and reshapes, each tile's mask, and the sweeps."""

    def __init__(self, q_shape, k_shape, d_v, causal, tile, dtype):
        self.q_len = q_shape[-2]
        self.k_len = k_shape[-2]
        self.d_v = d_v
        self.bq, self.bk = tile
        self.n = -(-self.q_len // self.bq)
        self.m = -(-self.k_len // self.bk)
        self.causal = causal
        self.dtype = dtype  # of the scores and the sums
        self.lowest = float(np.finfo(dtype).min)  # of masked scores, and the running maximum's start

    # --- blocking -----------------------------------------------------------------------------

    def query_blocks(self, x):
        """(*lead, T_q, d) -> (n, *lead, bq, d); padded query rows are zeros, dropped at the end."""
        return _to_blocks(x, self.n, self.bq)

    def key_blocks(self, x):
        """(*lead, T_k, d) -> (m, *lead, bk, d); padded keys are masked in every tile."""
        return _to_blocks(x, self.m, self.bk)

    def from_query_blocks(self, x):
        return _from_blocks(x, self.q_len)

    def from_key_blocks(self, x):
        return _from_blocks(x, self.k_len)

    def mask_tiles(self, keep):
        """keep (*lead|1, T_q|1, T_k|1) -> (n|1, m|1, *lead|1, bq|1, bk|1)."""
        *lead, kq, kk = keep.shape
        no_pad = [(0, 0)] * len(lead)
        if kq not in (1, self.n * self.bq):
            keep = ops.pad(keep, no_pad + [(0, self.n * self.bq - kq), (0, 0)], constant_values=True)
        if kk not in (1, self.m * self.bk):
            keep = ops.pad(keep, no_pad + [(0, 0), (0, self.m * self.bk - kk)], constant_values=False)
        n, bq = (self.n, self.bq) if kq != 1 else (1, 1)
        m, bk = (self.m, self.bk) if kk != 1 else (1, 1)
        keep = ops.reshape(keep, _known((*lead, n, bq, m, bk)))
        r = len(lead)
        return ops.transpose(keep, (r, r + 2, *range(r), r + 1, r + 3))

    def tile_keep(self, keep, i, j):
        """The keep-mask of tile (i, j), broadcastable to (*lead, bq, bk), or None when all is kept.

        `keep` is None or the user's mask in tiles (`mask_tiles`)."""
        if keep is not None:
            keep = keep[i if keep.shape[0] != 1 else 0][j if keep.shape[1] != 1 else 0]
        if self.causal or self.m * self.bk != self.k_len:
            columns = j * self.bk + ops.arange(self.bk, dtype="int32")  # (bk,) key positions
            if self.causal:
                rows = i * self.bq + ops.arange(self.bq, dtype="int32") + (self.k_len - self.q_len)  # (bq,)
                keep = _and(keep, columns[None, :] <= rows[:, None])  # (bq, bk); also hides padded keys
            else:
                keep = _and(keep, columns < self.k_len)  # (bk,): padded keys
        return keep

    def key_range(self, i):
        """Key blocks [0, end) that query block i sees: all, or up to the diagonal when causal."""
        if not self.causal:
            return 0, self.m
        last_key = (i + 1) * self.bq - 1 + (self.k_len - self.q_len)  # of the block's last query
        return 0, _clip(last_key // self.bk + 1, 0, self.m)

    def query_range(self, j):
        """Query blocks [start, n) that see key block j: all, or from the diagonal on when causal."""
        if not self.causal:
            return 0, self.n
        first_query = j * self.bk - (self.k_len - self.q_len)  # the first that sees the block's first key
        return _clip(first_query // self.bq, 0, self.n), self.n

    def scores(self, q_s, k, keep, i, j):
        """Tile (i, j) of the scores, (*lead, bq, bk), masked entries at the dtype's minimum, and its mask."""
        s = ops.matmul(q_s, ops.swapaxes(k, -1, -2))
        keep = self.tile_keep(keep, i, j)
        if keep is not None:
            s = ops.where(keep, s, constant(self.lowest, self.dtype))
        return s, keep

    def weights(self, s, reference, keep):
        """exp(s - reference[..., None]), exactly 0 where `keep` is False."""
        p = ops.exp(s - reference[..., None])
        return p if keep is None else ops.where(keep, p, ops.zeros((), self.dtype))

    # --- the sweeps ---------------------------------------------------------------------------

    def forward(self, q_s, k_b, v_b, keep_tiles):
        """Outputs and log-sum-exps per query block: (n, *lead, bq, d_v), (n, *lead, bq)."""

        def query_block(block):
            q, i = block["q"], block["i"]
            zeros = ops.zeros_like(q[..., 0])  # (*lead, bq)
            lowest = zeros + constant(self.lowest, self.dtype)

            def step(j, carry):
                o, l, m, seen = carry  # (*lead, bq, d_v), (*lead, bq), (*lead, bq), (*lead, bq)
                s, keep = self.scores(q, k_b[j], keep_tiles, i, j)  # (*lead, bq, bk)
                m_new = ops.maximum(m, ops.max(s, axis=-1))
                p = self.weights(s, m_new, keep)  # masked entries 0: rows with no key so far stay at l = 0
                rescale = ops.exp(m - m_new)
                seen = ops.logical_or(seen, True if keep is None else ops.any(keep, axis=-1))
                return o * rescale[..., None] + ops.matmul(p, v_b[j]), l * rescale + ops.sum(p, axis=-1), m_new, seen

            o0 = zeros[..., None] + ops.zeros((self.d_v,), self.dtype)
            o, l, m, seen = ops.fori_loop(*self.key_range(i), step, (o0, zeros, lowest, zeros > 0))
            attended = l > 0
            # l = 0 with a key kept: every kept score was -inf, whose softmax is NaN (0 / 0) as on the
            # explicit path; with no key kept, the row has nothing to attend to and stays zero.
            undefined = ops.logical_and(seen, ops.logical_not(attended))
            l = ops.where(attended, l, ops.where(undefined, constant(float("nan"), self.dtype), ops.ones((), self.dtype)))
            return o / l[..., None], ops.where(attended, m + ops.log(l), ops.where(undefined, l, zeros))

        return ops.map(query_block, {"q": q_s, "i": ops.arange(self.n, dtype="int32")})

    def backward(self, q_s, k_b, v_b, keep_tiles, o_b, lse_b, d_o_b):
        """Gradients in blocks: dS K per query block (times scale later), (n, *lead, bq, d_k); dK and dV
        per key block, (m, *lead, bk, d_k) and (m, *lead, bk, d_v). One sweep over the key blocks, and
        for each over the query blocks that see it."""
        delta_b = ops.sum(d_o_b * o_b, axis=-1)  # D (n, *lead, bq)

        def weights_and_ds(q, k, v, lse, d_o, delta, i, j):
            s, keep = self.scores(q, k, keep_tiles, i, j)
            p = self.weights(s, lse, keep)  # P (*lead, bq, bk)
            d_p = ops.matmul(d_o, ops.swapaxes(v, -1, -2))
            return p, p * (d_p - delta[..., None])  # P, dS

        def key_block(j, carry):
            d_q, d_k, d_v = carry  # (n, *lead, bq, d_k), (m, *lead, bk, d_k), (m, *lead, bk, d_v)
            k, v = k_b[j], v_b[j]

            def step(i, inner):
                d_q, d_k_j, d_v_j = inner
                q, d_o = q_s[i], d_o_b[i]
                p, d_s = weights_and_ds(q, k, v, lse_b[i], d_o, delta_b[i], i, j)
                d_q = _update(d_q, i, d_q[i] + ops.matmul(d_s, k))
                d_k_j = d_k_j + ops.matmul(ops.swapaxes(d_s, -1, -2), q)
                return d_q, d_k_j, d_v_j + ops.matmul(ops.swapaxes(p, -1, -2), d_o)

            d_q, d_k_j, d_v_j = ops.fori_loop(*self.query_range(j), step, (d_q, ops.zeros_like(k), ops.zeros_like(v)))
            return d_q, _update(d_k, j, d_k_j), _update(d_v, j, d_v_j)

        return ops.fori_loop(0, self.m, key_block, (ops.zeros_like(q_s), ops.zeros_like(k_b), ops.zeros_like(v_b)))


def _clip(x, low, high):
    """`x` clipped to [low, high]: a Python int, or a tensor (a block index traced in a loop)."""
    return min(max(x, low), high) if isinstance(x, int) else ops.clip(x, low, high)


def _update(blocks, index, block):
    """`blocks` (count, ...) with blocks[index] = block (in place under XLA's while loops)."""
    return ops.slice_update(blocks, (index,) + (0,) * (len(blocks.shape) - 1), block[None])


def _and(a, b):
    return b if a is None else ops.logical_and(a, b)


def _known(shape):
    # A traced batch of unknown size (tf.function) is the one dimension reshape may infer.
    return tuple(-1 if d is None else d for d in shape)


def _to_blocks(x, count, size):
    """(*lead, T, d) -> (count, *lead, size, d), T padded with zeros to count * size."""
    if count * size != x.shape[-2]:
        x = ops.pad(x, [(0, 0)] * (len(x.shape) - 2) + [(0, count * size - x.shape[-2]), (0, 0)])
    x = ops.reshape(x, _known((*x.shape[:-2], count, size, x.shape[-1])))
    return ops.moveaxis(x, -3, 0)


def _from_blocks(x, length):
    """(count, *lead, size, d) -> (*lead, length, d), dropping the padding."""
    count, *lead, size, d = x.shape
    x = ops.moveaxis(x, 0, -3)  # (*lead, count, size, d)
    return ops.reshape(x, _known((*lead, count * size, d)))[..., :length, :]
