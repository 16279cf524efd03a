"""GGUF quantized blocks repacked, exactly, into the one layout attnkit's block kernels read
(docs/decisions.md item 125).

Every type kept packed dequantizes as w = scale_g * (q - zero) + offset_g for the weights of one
group g of `group` consecutive inputs, with q a small integer:

    type  group  q (stored)                    zero  scale              offset
    Q4_0  32     4-bit, two per byte            8    d (float16)        none
    Q4_1  32     4-bit, two per byte            0    d (float16)        m (float16)
    Q4_K  32     4-bit, two per byte            0    d * sc (float32)   -(dmin * m) (float32)
    Q8_0  32     int8                           0    d (float16)        none
    Q6_K  16     int8 (6-bit, -32..31)          0    d * sc (float32)   none

The scale and offset are computed with gguf's own float32 operations in its order, so
`dequantize_numpy(repack(t))` equals `gguf.quants.dequantize(t)` bit for bit (tests/kernels). The
4-bit values of a group of 32 are stored in 16 bytes, element i in the low nibble of byte i and
element i + 16 in its high nibble (Q4_0's and Q4_1's own order; Q4_K's 64-element chunks are
reordered into it). Q4_0's, Q4_1's and Q8_0's scales and minimums are the file's own float16 numbers,
kept as float16 (every kernel widens them exactly: a step reads 17% fewer bytes of Q4_1 than with
float32 scales, docs/decisions.md item 147); Q4_K's and Q6_K's products d * sc are not float16
numbers and are kept in float32. Bits per weight: 4.5 for Q4_0, 5 for Q4_1, 6 for Q4_K, 8.5 for
Q8_0, 10 for Q6_K (GGUF: 4.5, 5, 4.5, 8.5, 6.56).

Legend: N rows (outputs), K columns (inputs), G = K / group groups per row.
"""

import dataclasses

import numpy as np

QK_K = 256  # a K-quant super-block
PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")


@dataclasses.dataclass
class BlockWeights:
    """A weight matrix (N, K) as integer values with per-group scales and offsets.

    Attributes:
        type_name: the GGUF type it came from ("Q4_0", ...).
        bits: 4 (values: uint8 (N, K / 2), two per byte) or 8 (values: int8 (N, K)).
        values: the packed integers.
        scale: float16 or float32 (N, G).
        offset: (N, G) in scale's dtype, or None (zero).
        zero: the integer subtracted from every value before scaling (8 for Q4_0).
        group: inputs per group (32 or 16).
        shape: (N, K).
    """

    type_name: str
    bits: int
    values: np.ndarray
    scale: np.ndarray
    offset: object
    zero: int
    group: int
    shape: tuple

    @property
    def nbytes(self):
        """Bytes held: values, scales and offsets."""
        return self.values.nbytes + self.scale.nbytes + (0 if self.offset is None else self.offset.nbytes)

    def take_rows(self, order):
        """The same weights with rows in `order` (an index array over N): W_q's and W_k's rows are
        permuted back from llama.cpp's layout this way (`gguf_checkpoint.unpermute`)."""
        take = lambda a: None if a is None else np.ascontiguousarray(a[order])
        return dataclasses.replace(self, values=take(self.values), scale=take(self.scale), offset=take(self.offset))


def repack(data, type_name, shape, name="the tensor"):
    """A GGUF tensor's raw blocks (uint8, as `GGUFReader` gives them) as `BlockWeights` of `shape` (N, K).

    Raises:
        ValueError: a type not in PACKED_TYPES, or K not a whole number of blocks, naming the tensor.
    """
    if type_name not in PACKED_TYPES:
        raise ValueError(
            f"GGUF tensor {name!r} has quantization type {type_name}, which attnkit cannot keep packed "
            f"(it keeps {', '.join(PACKED_TYPES)}); load it with dtype='float32' to dequantize it"
        )
    n, k = (int(d) for d in shape)
    block = QK_K if type_name.endswith("_K") else 32
    if k % block:
        raise ValueError(f"GGUF tensor {name!r}: {k} inputs are not whole {type_name} blocks of {block}")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(n * (k // block), -1)  # (blocks, bytes per block)
    return _REPACK[type_name](blocks, n, k)


def _half(raw):
    """Little-endian float16 bytes (..., 2) as float32 (..., 1)."""
    return _float16(raw).astype(np.float32)


def _float16(raw):
    """Little-endian float16 bytes (..., 2) as float16 (..., 1), as stored."""
    return np.ascontiguousarray(raw).view(np.float16)


def _nibbles_per_group(blocks16, n, k):
    """Bytes already in the group-of-32 nibble order, (blocks, 16 per group...) -> uint8 (N, K / 2)."""
    return np.ascontiguousarray(blocks16).reshape(n, k // 2)


def pack_nibbles(q):
    """uint8 values 0..15 (N, K) -> (N, K / 2): per group of 32, element i low and i + 16 high."""
    n, k = q.shape
    g = q.reshape(n, k // 32, 2, 16)  # (N, G, half, 16)
    return (g[:, :, 0] | (g[:, :, 1] << np.uint8(4))).reshape(n, k // 2)


def _q4_0(blocks, n, k):
    d, qs = blocks[:, :2], blocks[:, 2:]  # (blocks, 2), (blocks, 16)
    return BlockWeights("Q4_0", 4, _nibbles_per_group(qs, n, k), _float16(d).reshape(n, k // 32), None, 8, 32, (n, k))


def _q4_1(blocks, n, k):
    d, m, qs = blocks[:, :2], blocks[:, 2:4], blocks[:, 4:]
    return BlockWeights(
        "Q4_1", 4, _nibbles_per_group(qs, n, k), _float16(d).reshape(n, k // 32), _float16(m).reshape(n, k // 32), 0, 32, (n, k)
    )


def _q8_0(blocks, n, k):
    d, qs = blocks[:, :2], blocks[:, 2:]
    return BlockWeights("Q8_0", 8, np.ascontiguousarray(qs).view(np.int8).reshape(n, k), _float16(d).reshape(n, k // 32), None, 0, 32, (n, k))


def _q4_k(blocks, n, k):
    from gguf.quants import Q4_K

    d, dmin = _half(blocks[:, :2]), _half(blocks[:, 2:4])  # (blocks, 1) each
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])  # (blocks, 8) each: one per sub-block of 32
    scale = d * sc.astype(np.float32)  # gguf's own product, in float32
    offset = -(dmin * m.astype(np.float32))
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)  # (blocks, chunk, nibble, 32)
    q = (qs & np.uint8(0x0F)).reshape(n, k)  # elements in order: a chunk's low nibbles, then its high ones
    return BlockWeights("Q4_K", 4, pack_nibbles(q), scale.reshape(n, k // 32), offset.reshape(n, k // 32), 0, 32, (n, k))


def _q6_k(blocks, n, k):
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc, d = blocks[:, 192:208].view(np.int8).astype(np.float32), _half(blocks[:, 208:210])  # (blocks, 16), (blocks, 1)
    scale = d * sc  # gguf's own product
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)  # (blocks, 2, 2, 64)
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(0x03)  # (blocks, 2, 4, 32)
    q = (low.reshape(-1, 2, 4, 32) | (high << np.uint8(4))).astype(np.int8) - np.int8(32)  # as gguf orders them
    return BlockWeights("Q6_K", 8, q.reshape(n, k), scale.reshape(n, k // 16), None, 0, 16, (n, k))


_REPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


def dequantize_numpy(weights):
    """The float32 matrix (N, K) of `BlockWeights`, in gguf's operations: the exactness reference of
    the repacking (equal to `gguf.quants.dequantize` bit for bit)."""
    n, k = weights.shape
    g = weights.group
    if weights.bits == 4:
        v = weights.values.reshape(n, k // 32, 16)
        q = np.concatenate([v & np.uint8(0x0F), v >> np.uint8(4)], axis=-1).astype(np.int8)  # (N, G, 32)
    else:
        q = weights.values.reshape(n, k // g, g)
    q = (q - np.int8(weights.zero)).astype(np.float32)
    w = weights.scale.astype(np.float32)[..., None] * q  # a float16 scale widened exactly, as gguf does
    if weights.offset is not None:
        w = w + weights.offset.astype(np.float32)[..., None]
    return w.reshape(n, k)
