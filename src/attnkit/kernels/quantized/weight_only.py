"""Float weights quantized into `BlockWeights` (docs/decisions.md item 138): what `--dtype int8` and
`--dtype int4` hold, in the layout the block kernels read (the same as a GGUF file's kept blocks).

    int8: one group per row (group = K), symmetric:  s_n = max_k |W[n, k]| / 127,
          q = round(W / s_n) in -127..127,            W ~ s_n q
    int4: groups of 32 inputs, with a minimum (Q4_1's form, better than a symmetric 4-bit scale for
          the skewed groups of real weights):  s_g = (max_g - min_g) / 15,
          q = round((W - min_g) / s_g) in 0..15,      W ~ s_g q + min_g

All in float64, then scales and offsets stored as float32: a weight's error is at most half of its
stored step, s / 2 (tests/kernels/test_weight_only.py). A row (int8) or group (int4) of zeros gets
scale 1; a step that float32 cannot hold (below its smallest subnormal) its smallest subnormal.

Legend: N outputs, K inputs, G = K / group.
"""

import numpy as np

from attnkit.kernels.quantized.gguf_blocks import BlockWeights

INT4_GROUP = 32  # inputs per int4 scale and minimum: llama.cpp's Q4 group, the nibble layout's


def quantize_int8(weights, name="W"):
    """W (N, K) float -> `BlockWeights` ("int8": int8 values (N, K), float32 scale (N, 1)).

    Raises:
        ValueError: a NaN or infinite weight (named by `name`): no integer stands for it.
    """
    w = _finite(weights, name)
    n, k = w.shape
    scale = _float32_step(np.max(np.abs(w), axis=1, keepdims=True) / 127.0)  # (N, 1)
    q = np.clip(np.rint(w / scale.astype(np.float64)), -127, 127).astype(np.int8)  # (N, K)
    return BlockWeights("int8", 8, q, scale, None, 0, k, (n, k))


def quantize_int4(weights, name="W"):
    """W (N, K) float, K a multiple of 32 -> `BlockWeights` ("int4": uint8 nibbles (N, K / 2), float32
    scale and minimum (N, G)).

    Raises:
        ValueError: K not a multiple of INT4_GROUP; a NaN or infinite weight.
    """
    w = _finite(weights, name)
    n, k = w.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 groups of {INT4_GROUP} inputs need K a multiple of {INT4_GROUP}. Received: W of shape {(n, k)}")
    groups = w.reshape(n, k // INT4_GROUP, INT4_GROUP)  # (N, G, 32)
    low, high = groups.min(axis=-1), groups.max(axis=-1)  # (N, G)
    scale = _float32_step((high - low) / 15.0)
    offset = low.astype(np.float32)
    q = np.rint((groups - offset[..., None].astype(np.float64)) / scale[..., None].astype(np.float64))
    q = np.clip(q, 0, 15).astype(np.uint8)  # (N, G, 32)
    # element i in the low nibble of byte i, element i + 16 in its high nibble (gguf_blocks' layout)
    packed = q[..., :16] | (q[..., 16:] << 4)  # (N, G, 16)
    return BlockWeights("int4", 4, packed.reshape(n, k // 2), scale, offset, 0, INT4_GROUP, (n, k))


def _finite(weights, name):
    w = np.asarray(weights, np.float64)
    if not np.all(np.isfinite(w)):
        bad = np.argwhere(~np.isfinite(w))[0]
        raise ValueError(f"{name} holds {int(np.sum(~np.isfinite(w)))} NaN or infinite weights (the first at {tuple(int(i) for i in bad)}); "
                         "they cannot be quantized. Received: a checkpoint with non-finite weights")
    return w


def _float32_step(step):
    """float64 steps -> float32: 1 for an all-zero row or group, at least the smallest subnormal where
    the step underflows (a row of subnormal weights would otherwise get scale 0 and lose them all)."""
    tiny = np.nextafter(np.float32(0), np.float32(1))
    return np.where(step > 0, np.maximum(step.astype(np.float32), tiny), np.float32(1.0)).astype(np.float32)
