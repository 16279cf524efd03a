"""Packed blocks of every GGUF type for kernel tests: gguf's own quantization, or random K-quant blocks."""

import numpy as np

from attnkit.kernels.quantized import repack
from attnkit.kernels.quantized.gguf_blocks import dequantize_numpy

N, K = 40, 512  # K: two Q4_K / Q6_K super-blocks


# K of 3 and of 11 blocks of 32: the kernels' loops over eight groups at a time, and what remains
ODD_K = (96, 352)


def packed(type_name, seed, k=K):
    """(BlockWeights, its float64 dequantization (N, k)) from blocks gguf writes, or random K-quant blocks
    (k a multiple of 256 for those)."""
    import gguf

    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[type_name]
    try:
        raw = gguf.quants.quantize(rng.standard_normal((N, k)).astype(np.float32), kind)
    except NotImplementedError:  # gguf cannot quantize K-quants: random blocks with finite float16 scales
        block, size = gguf.constants.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (N, k // block * size), dtype=np.uint8)
        halves = {"Q4_K": (0, 2), "Q6_K": (208,)}[type_name]
        for b in range(k // block):
            for h in halves:
                raw[:, b * size + h : b * size + h + 2] = np.frombuffer(
                    rng.uniform(0.01, 0.1, N).astype(np.float16).tobytes(), np.uint8
                ).reshape(N, 2)
    weights = repack(raw, type_name, (N, k))
    return weights, dequantize_numpy(weights).astype(np.float64)


def tensors(weights):
    """The packed arrays as CPU torch tensors (values, scale, offset or None)."""
    import torch

    offset = None if weights.offset is None else torch.from_numpy(weights.offset)
    return torch.from_numpy(weights.values), torch.from_numpy(weights.scale), offset


def layout(weights):
    return dict(bits=weights.bits, zero=weights.zero, group=weights.group, shape=weights.shape)
