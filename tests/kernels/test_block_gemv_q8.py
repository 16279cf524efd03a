"""q8 activations (docs/decisions.md item 144): x rounded to 8-bit blocks of 32 as llama.cpp's Q8_0
rounds it, then integer dot products. Checked against a float64 NumPy model of the rounding and the
product: `block_gemv_q8` (AVX2 and plain C) for every packed type, `round_q8` in keras ops on every
backend, `block_linear` giving the same numbers on its kernel and its GEMM path, rows that cannot be
rounded multiplied unrounded, and layouts it cannot take refused."""

import numpy as np
import pytest
from backend_utils import BACKEND, to_numpy
from hypothesis import given, settings, strategies as st

gguf = pytest.importorskip("gguf")

from packed_blocks import K, N, ODD_K, layout, packed  # noqa: E402

from attnkit.kernels.quantized import PACKED_TYPES, block_gemv, block_linear  # noqa: E402
from attnkit.kernels.quantized.block_matmul import round_q8  # noqa: E402

torch_only = pytest.mark.skipif(BACKEND != "torch", reason="block_gemv is torch's CPU kernel")


def rounded(x):
    """x (M, K) -> x^ float64: d = float16(max|x_b| / 127), q = round-half-even(x 127 / max|x_b|), x^ = d q
    per block of 32, in float32 as the kernel computes d and q; rows with a block that cannot be
    rounded unrounded."""
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // 32, 32)
    top = np.abs(blocks).max(-1, keepdims=True)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        d = (top / np.float32(127)).astype(np.float16).astype(np.float32)
        inverse = np.where(top > 0, np.float32(127) / np.where(top > 0, top, 1), 0).astype(np.float32)
        q = np.rint(blocks * inverse)
    fine = np.isfinite(blocks).all((1, 2)) & np.isfinite(d).all((1, 2))
    out = np.where(fine[:, None, None], q * d, blocks)
    return out.reshape(m, k).astype(np.float64)


def assert_q8_product(y, x, reference):
    """y = x^ W^T up to float32 accumulation (the integer sums are exact)."""
    xr = rounded(x)
    bound = 1e-5 * (np.abs(xr) @ np.abs(reference).T) + 1e-6
    assert np.all(np.abs(y - xr @ reference.T) <= bound), np.max(np.abs(y - xr @ reference.T) / bound)


def _product(x, weights, library=None):
    import torch

    offset = None if weights.offset is None else torch.from_numpy(weights.offset)
    return block_gemv.block_gemv(
        torch.from_numpy(x), torch.from_numpy(weights.values), torch.from_numpy(weights.scale), offset,
        **layout(weights), activations="q8", library=library,
    ).numpy()


@torch_only
@pytest.mark.parametrize("type_name", PACKED_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_the_q8_kernel_is_the_rounded_product(type_name, rows):
    weights, reference = packed(type_name, seed=rows)
    x = np.random.default_rng(rows).standard_normal((rows, K)).astype(np.float32) * np.float32(3)
    x[0, :32] = 0  # a block of zeros: scale 0
    assert_q8_product(_product(x, weights), x, reference)


@torch_only
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("k", ODD_K)
@pytest.mark.parametrize("rows", [1, 5])
def test_blocks_beyond_the_last_eight_are_multiplied_too(type_name, k, rows):
    weights, reference = packed(type_name, seed=k, k=k)
    x = np.random.default_rng(k + rows).standard_normal((rows, k)).astype(np.float32)
    assert_q8_product(_product(x, weights), x, reference)


@torch_only
@pytest.mark.parametrize("type_name", PACKED_TYPES)
def test_the_plain_c_q8_path_gives_the_same_products(type_name):
    """A build without AVX2, FMA or F16C: scalar integer sums and float16 rounding done by hand."""
    library = block_gemv.build(("-O2", "-mno-avx2", "-mno-fma", "-mno-f16c", "-fopenmp", "-shared", "-fPIC"))
    weights, reference = packed(type_name, seed=3)
    x = np.random.default_rng(4).standard_normal((6, K)).astype(np.float32) * np.float32(1e-4)  # float16 subnormal scales too
    assert_q8_product(_product(x, weights, library), x, reference)


@torch_only
@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan, 1e9])
def test_a_row_that_cannot_be_rounded_is_multiplied_unrounded(value):
    """An infinity or NaN, or a block whose scale overflows float16 (|x| > 127 * 65504): that row is
    float arithmetic's product, the other rows stay rounded."""
    weights, reference = packed("Q4_1", seed=5)
    x = np.random.default_rng(5).standard_normal((3, K)).astype(np.float32)
    x[1, 40] = value
    y = _product(x, weights)
    assert_q8_product(y[[0, 2]], x[[0, 2]], reference)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = x[1:2].astype(np.float64) @ reference.T
    np.testing.assert_array_equal(np.isnan(y[1]), np.isnan(expected[0]))
    finite = np.isfinite(expected[0])
    np.testing.assert_allclose(y[1][finite], expected[0][finite], rtol=1e-5)
    np.testing.assert_array_equal(y[1][~finite], expected[0][~finite])


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 6), blocks=st.integers(1, 4), magnitude=st.floats(1e-6, 1e6), seed=st.integers(0, 2**16),
)
def test_round_q8_is_llama_cpps_rounding_on_every_backend(rows, blocks, magnitude, seed):
    x = (np.random.default_rng(seed).standard_normal((rows, 32 * blocks)) * magnitude).astype(np.float32)
    ours = to_numpy(round_q8(x))
    np.testing.assert_array_equal(ours, rounded(x).astype(np.float32))
    # each element within half a step, plus what storing the step in float16 moves (all of it for a
    # block below float16's range, max|x_b| < 127 * 2^-24, which rounds to 0 as llama.cpp's does)
    d = np.abs(x.astype(np.float64)).reshape(rows, blocks, 32).max(-1, keepdims=True) / 127
    d16 = d.astype(np.float16).astype(np.float64)
    error = np.abs(ours.astype(np.float64) - x).reshape(rows, blocks, 32)
    assert np.all(error <= (0.5 * d + 127 * np.abs(d16 - d)) * (1 + 1e-5))


def test_block_linear_q8_is_one_product_whatever_the_rows():
    """A decoding step's few rows (the kernel on torch) and a prefill's many (rounded x times the
    dequantized W) compute the same x^ W^T: a row's result does not depend on its batch."""
    weights, reference = packed("Q4_0", seed=9)
    x = np.random.default_rng(9).standard_normal((40, K)).astype(np.float32)
    arguments = [weights.values, weights.scale, weights.offset]
    many = to_numpy(block_linear(x, *arguments, **layout(weights), activations="q8"))
    few = np.concatenate([to_numpy(block_linear(x[i : i + 4], *arguments, **layout(weights), activations="q8")) for i in range(0, 40, 4)])
    assert_q8_product(many, x, reference)
    assert_q8_product(few, x, reference)


def test_no_rows_give_no_rows():
    weights, _ = packed("Q4_1", seed=2)
    y = block_linear(np.zeros((0, K), np.float32), weights.values, weights.scale, weights.offset, **layout(weights), activations="q8")
    assert tuple(y.shape) == (0, N)
    assert tuple(round_q8(np.zeros((2, 0, K), np.float32)).shape) == (2, 0, K)


@pytest.mark.parametrize("group, bits", [(8, 8), (48, 8)])
def test_layouts_q8_cannot_take_are_refused(group, bits):
    values = np.zeros((N, K), np.int8)
    scale = np.ones((N, K // group), np.float32)
    with pytest.raises(ValueError, match="q8 activations need"):
        block_linear(np.ones((1, K), np.float32), values, scale, None, bits=bits, zero=0, group=group, shape=(N, K), activations="q8")
