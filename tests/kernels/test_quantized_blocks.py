"""GGUF blocks kept packed (docs/decisions.md items 125-127): the repacking dequantizes to
`gguf.quants.dequantize`'s float32 bit for bit, and the block kernel's x W^T + b equals a float64
NumPy product of gguf's dequantization within float32 accumulation, per type, on every backend.
Tensors are quantized with `gguf.quants.quantize` where gguf can (Q4_0, Q4_1, Q8_0), else random
blocks with finite float16 scales (Q4_K, Q6_K)."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import keras  # noqa: E402
from gguf import GGMLQuantizationType, quants  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from attnkit.kernels.quantized import PACKED_TYPES, repack  # noqa: E402
from attnkit.kernels.quantized.gguf_blocks import dequantize_numpy  # noqa: E402
from attnkit.layers.block_quantized import keep_blocks  # noqa: E402
from attnkit.layers.linear import Linear  # noqa: E402

N, K = 24, 512  # K: two K-quant super-blocks

# Where a type's float16 scales sit in its block (bytes), for hand-built random blocks.
_HALF_OFFSETS = {"Q4_K": (0, 2), "Q6_K": (208,)}


def quantized(type_name, seed=0):
    """(raw blocks uint8 (N, bytes per row), gguf's float32 dequantization (N, K)) of one type."""
    rng = np.random.default_rng(seed)
    kind = GGMLQuantizationType[type_name]
    try:
        raw = quants.quantize(rng.standard_normal((N, K)).astype("float32"), kind)
    except NotImplementedError:  # gguf cannot quantize the K-quants: random blocks, finite scales
        block, size = GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (N * K // block, size), dtype=np.uint8)
        for offset in _HALF_OFFSETS[type_name]:
            raw[:, offset:offset + 2] = (rng.uniform(0.001, 0.05, (len(raw), 1))).astype(np.float16).view(np.uint8)
        raw = raw.reshape(N, -1)
    return raw, quants.dequantize(raw, kind).reshape(N, K)


@pytest.mark.parametrize("type_name", PACKED_TYPES)
def test_repacking_dequantizes_as_gguf_bit_for_bit(type_name):
    raw, reference = quantized(type_name)
    weights = repack(raw, type_name, (N, K))
    np.testing.assert_array_equal(dequantize_numpy(weights), reference)
    assert weights.nbytes < 0.35 * reference.nbytes  # packed: at most 10 bits a weight, not 32


@pytest.mark.parametrize("type_name", PACKED_TYPES)
def test_the_files_float16_scales_are_kept_as_stored(type_name):
    """Q4_0's, Q4_1's and Q8_0's d (and Q4_1's m) are float16 in the file and stay so, byte for byte
    (docs/decisions.md item 147); Q4_K's and Q6_K's products d * sc are kept in float32."""
    raw, _ = quantized(type_name, seed=3)
    weights = repack(raw, type_name, (N, K))
    if type_name.endswith("_K"):
        assert weights.scale.dtype == np.float32 and (weights.offset is None or weights.offset.dtype == np.float32)
        return
    size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]
    blocks = raw.reshape(N * K // 32, size)
    assert weights.scale.dtype == np.float16
    np.testing.assert_array_equal(weights.scale.reshape(-1).view(np.uint8).reshape(-1, 2), blocks[:, :2])
    if type_name == "Q4_1":
        assert weights.offset.dtype == np.float16
        np.testing.assert_array_equal(weights.offset.reshape(-1).view(np.uint8).reshape(-1, 2), blocks[:, 2:4])
    bits = {"Q4_0": 4.5, "Q4_1": 5, "Q8_0": 8.5}[type_name]
    assert weights.nbytes == N * K * bits / 8  # the file's own size


@pytest.mark.parametrize("type_name", PACKED_TYPES)
@pytest.mark.parametrize("batch", [(1,), (2, 3)])
def test_block_linear_equals_float64_product_of_gguf_dequantization(type_name, batch):
    raw, reference = quantized(type_name, seed=1)
    rng = np.random.default_rng(2)
    dense = Linear(N)
    dense.build((None, K))
    bias = rng.standard_normal(N).astype("float32")
    dense.bias.assign(bias)
    keep_blocks(dense, repack(raw, type_name, (N, K)))
    assert dense.quantization_mode in ("int4", "int8") and not any("kernel" in v.path for v in dense.variables)
    x = rng.standard_normal((*batch, K)).astype("float32")
    y = keras.ops.convert_to_numpy(dense(x))
    expected = x.astype("float64") @ reference.astype("float64").T + bias
    # float32 accumulation of K products: relative to the sum of their magnitudes
    bound = 1e-5 * (np.abs(x) @ np.abs(reference).T + np.abs(bias)) + 1e-6
    assert y.shape == (*batch, N) and y.dtype == np.float32
    assert np.all(np.abs(y - expected) <= bound), np.max(np.abs(y - expected) / bound)


def test_a_type_attnkit_cannot_keep_packed_is_refused_by_name():
    raw = quants.quantize(np.ones((2, 64), np.float32), GGMLQuantizationType.Q5_0)
    with pytest.raises(ValueError, match=r"'blk.0.attn_q.weight' has quantization type Q5_0, which attnkit cannot keep packed"):
        repack(raw, "Q5_0", (2, 64), name="blk.0.attn_q.weight")


def test_blocks_of_another_shape_are_refused():
    dense = Linear(N)
    dense.build((None, K // 2))
    raw, _ = quantized("Q8_0")
    with pytest.raises(ValueError, match=r"do not fit"):
        keep_blocks(dense, repack(raw, "Q8_0", (N, K)))


@pytest.mark.parametrize("type_name", PACKED_TYPES)
def test_the_products_dequantization_is_ggufs_bit_for_bit(type_name):
    """`block_matmul.dequantize`, the GEMM path's W (one pass in C on torch's CPU, keras ops
    elsewhere), is gguf's float32 dequantization exactly."""
    from backend_utils import to_numpy

    from attnkit.kernels.quantized import dequantize

    raw, reference = quantized(type_name, seed=3)
    weights = repack(raw, type_name, (N, K))
    tensors = [None if a is None else keras.ops.convert_to_tensor(a) for a in (weights.values, weights.scale, weights.offset)]
    w = dequantize(*tensors, bits=weights.bits, zero=weights.zero, group=weights.group, shape=weights.shape)
    np.testing.assert_array_equal(to_numpy(w), reference)
