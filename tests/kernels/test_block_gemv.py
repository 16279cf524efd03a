"""`block_gemv`, torch's CPU kernel for a decoding step's packed products (docs/decisions.md item 136),
against a float64 product of `gguf.quants.dequantize`: every packed type, every tile of rows of x
(1-4 at a time, and a remainder), its plain-C path (a build without AVX2 and FMA, as on a CPU that
lacks them), and `block_linear` choosing it only where it applies."""

import numpy as np
import pytest
from backend_utils import BACKEND

if BACKEND != "torch":
    pytest.skip("block_gemv is torch's CPU kernel", allow_module_level=True)
gguf = pytest.importorskip("gguf")

import torch  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from packed_blocks import K, N, ODD_K, layout, packed, tensors  # noqa: E402

from attnkit.kernels.quantized import PACKED_TYPES, block_gemv, block_linear  # noqa: E402

def assert_float32_product(y, x, reference):
    expected = x.astype(np.float64) @ reference.T
    bound = 1e-5 * (np.abs(x) @ np.abs(reference).T) + 1e-6  # float32 accumulation, as block_linear's
    assert np.all(np.abs(y - expected) <= bound), np.max(np.abs(y - expected) / bound)


@pytest.mark.parametrize("type_name", PACKED_TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 32])
def test_block_gemv_equals_the_float64_product(type_name, rows):
    weights, reference = packed(type_name, seed=rows)
    x = np.random.default_rng(rows + 100).standard_normal((rows, K)).astype(np.float32)
    y = block_gemv.block_gemv(torch.from_numpy(x), *tensors(weights), **layout(weights)).numpy()
    assert y.shape == (rows, N) and y.dtype == np.float32
    assert_float32_product(y, x, reference)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("k", ODD_K)
@pytest.mark.parametrize("rows", [1, 5])
def test_groups_beyond_the_last_eight_are_multiplied_too(type_name, k, rows):
    weights, reference = packed(type_name, seed=k, k=k)
    x = np.random.default_rng(k + rows).standard_normal((rows, k)).astype(np.float32)
    y = block_gemv.block_gemv(torch.from_numpy(x), *tensors(weights), **layout(weights)).numpy()
    assert_float32_product(y, x, reference)


@pytest.mark.parametrize("type_name", PACKED_TYPES)
def test_the_plain_c_path_of_a_cpu_without_avx2_gives_the_same_products(type_name):
    library = block_gemv.build(("-O2", "-mno-avx2", "-mno-fma", "-fopenmp", "-shared", "-fPIC"))
    weights, reference = packed(type_name, seed=7)
    x = np.random.default_rng(8).standard_normal((6, K)).astype(np.float32)
    y = block_gemv.block_gemv(torch.from_numpy(x), *tensors(weights), **layout(weights), library=library).numpy()
    assert_float32_product(y, x, reference)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 12), threads=st.integers(1, 3), type_name=st.sampled_from(PACKED_TYPES), scale=st.floats(1e-3, 1e3))
def test_rows_are_independent_of_the_batch_and_the_threads(rows, threads, type_name, scale):
    """Each row of y is its row of x times W^T whatever the other rows and the thread count: a batch of
    decoding streams gives each stream what it would get alone."""
    weights, _ = packed(type_name, seed=3)
    x = torch.from_numpy(np.random.default_rng(rows).standard_normal((rows, K)).astype(np.float32) * scale)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = block_gemv.block_gemv(x, *tensors(weights), **layout(weights))
        alone = torch.cat([block_gemv.block_gemv(x[i : i + 1], *tensors(weights), **layout(weights)) for i in range(rows)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(together, alone)


def _widened(weights):
    """The same blocks with their float16 scales and offsets widened to float32 (the same numbers)."""
    import dataclasses

    widen = lambda a: None if a is None else a.astype(np.float32)
    return dataclasses.replace(weights, scale=widen(weights.scale), offset=widen(weights.offset))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("plain", [False, True])
def test_float16_scales_give_the_products_of_their_float32_values_bit_for_bit(type_name, plain):
    """The file's float16 scales (docs/decisions.md item 147) are widened exactly in every kernel:
    products, q8 products and the dequantization equal those of the same scales held in float32."""
    library = block_gemv.build(("-O2", "-mno-avx2", "-mno-fma", "-mno-f16c", "-fopenmp", "-shared", "-fPIC")) if plain else None
    weights, _ = packed(type_name, seed=11)
    assert weights.scale.dtype == np.float16
    wide = _widened(weights)
    x = torch.from_numpy(np.random.default_rng(12).standard_normal((7, K)).astype(np.float32))
    for activations in (None, "q8"):
        y16 = block_gemv.block_gemv(x, *tensors(weights), **layout(weights), activations=activations, library=library)
        y32 = block_gemv.block_gemv(x, *tensors(wide), **layout(wide), activations=activations, library=library)
        assert torch.equal(y16, y32), activations
    w16 = block_gemv.dequantize(*tensors(weights), **layout(weights), library=library)
    assert torch.equal(w16, block_gemv.dequantize(*tensors(wide), **layout(wide), library=library))


def test_scales_and_offsets_of_mixed_dtypes_are_refused_by_the_kernel_and_multiplied_by_block_linear():
    weights, reference = packed("Q4_1", seed=13)
    values, scale, offset = tensors(weights)
    x = torch.from_numpy(np.random.default_rng(14).standard_normal((2, K)).astype(np.float32))
    with pytest.raises(TypeError, match="float32 or float16 scales"):
        block_gemv.block_gemv(x, values, scale.float(), offset, **layout(weights))
    with pytest.raises(TypeError, match="float32 or float16 scales"):
        block_gemv.block_gemv(x, values, scale.double(), offset.double(), **layout(weights))
    y = block_linear(x, values, scale.float(), offset, **layout(weights)).numpy()  # the dequantize-then-GEMM path
    assert_float32_product(y, x.numpy(), reference)


def test_block_linear_uses_the_kernel_for_few_rows_and_the_gemm_beyond(monkeypatch):
    weights, reference = packed("Q4_1", seed=5)
    calls = []
    kernel = block_gemv.block_gemv
    monkeypatch.setattr(block_gemv, "block_gemv", lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    bias = np.random.default_rng(6).standard_normal(N).astype(np.float32)
    for shape in [(1, 1, K), (4, 8, K), (3, 11, K)]:  # 1 and 32 rows: the kernel; 33: dequantize then GEMM
        x = np.random.default_rng(shape[1]).standard_normal(shape).astype(np.float32)
        y = block_linear(torch.from_numpy(x), *tensors(weights), torch.from_numpy(bias), **layout(weights)).numpy()
        assert y.shape == (*shape[:-1], N)
        assert_float32_product(y.reshape(-1, N) - bias, x.reshape(-1, K), reference)
    assert calls == [1, 32]
    with torch.enable_grad():  # autograd: the GEMM path, which has a gradient
        x = torch.randn(1, K, requires_grad=True)
        block_linear(x, *tensors(weights), **layout(weights)).sum().backward()
    assert calls == [1, 32] and x.grad is not None


@pytest.mark.parametrize("rows, k", [(1, 576), (3, 40), (8, 1536), (32, 17)])
@pytest.mark.parametrize("plain", [False, True])
def test_bfloat16_gemv_multiplies_the_exact_widened_weights_in_float32(rows, k, plain):
    """bfloat16 W widened exactly, float32 sums: within float32 accumulation of the float64 product of
    the same bfloat16 values (decision 139); K not a multiple of 16 takes the tail loop."""
    library = block_gemv.build(("-O2", "-mno-avx2", "-mno-fma", "-fopenmp", "-shared", "-fPIC")) if plain else None
    rng = np.random.default_rng(rows + k)
    w = torch.from_numpy(rng.standard_normal((N, k)).astype(np.float32)).bfloat16()
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    y = block_gemv.bfloat16_gemv(x, w, library=library).numpy()
    assert_float32_product(y, x.numpy(), w.double().numpy())


def test_torch_linear_runs_bfloat16_decoding_rows_in_the_kernel_where_the_cpu_has_no_bfloat16_products(monkeypatch):
    from attnkit.kernels import onednn
    from attnkit.kernels.linear import torch_linear

    calls = []
    kernel = block_gemv.bfloat16_gemv
    monkeypatch.setattr(block_gemv, "bfloat16_gemv", lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k))
    rng = np.random.default_rng(0)
    w = torch.from_numpy(rng.standard_normal((K, N)).astype(np.float32)).bfloat16()  # Keras's (d_in, d_out)
    b = torch.from_numpy(rng.standard_normal(N).astype(np.float32)).bfloat16()
    for shape, activation in [((1, 1, K), None), ((2, 3, K), "relu"), ((4, 8, K), "gelu"), ((33, K), None)]:
        x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).bfloat16()
        y = torch_linear(x, w, b, activation)
        # the float32 path's arithmetic: exact casts, float32 products, the activation, one rounding
        expected = x.double() @ w.double() + b.double()
        expected = torch.relu(expected) if activation == "relu" else torch.nn.functional.gelu(expected) if activation else expected
        assert y.dtype == torch.bfloat16 and y.shape == (*shape[:-1], N)
        bound = 2.0**-8 * expected.abs() + 1e-5 * (x.double().abs() @ w.double().abs()) + 1e-6
        assert torch.all((y.double() - expected).abs() <= bound)
    assert calls == ([] if onednn.native_half(torch.bfloat16) else [1, 6, 32])


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_an_infinity_in_x_gives_the_products_infinities_not_nan(type_name):
    """The kernel's factored sums would give 0 * inf = NaN where a weight's integer is 0 but its value
    is not (an offset, Q4_0's zero point): those calls take the dequantized product instead."""
    weights, reference = packed(type_name, seed=11)
    x = np.random.default_rng(12).standard_normal((2, K)).astype(np.float32)
    x[0, 5] = np.inf
    y = block_linear(torch.from_numpy(x), *tensors(weights), **layout(weights)).numpy()
    with np.errstate(invalid="ignore"):
        expected = x.astype(np.float64) @ reference.T
    np.testing.assert_array_equal(np.isnan(y), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(y), np.isinf(expected))
    assert np.isinf(y[0]).sum() > 0 and np.all(np.isfinite(y[1]))


def test_x_of_another_dtype_is_multiplied_as_its_float32_cast_and_the_kernel_refuses_it():
    weights, reference = packed("Q4_1", seed=13)
    x = np.random.default_rng(14).standard_normal((1, K))
    y = block_linear(torch.from_numpy(x), *tensors(weights), **layout(weights)).numpy()  # float64 x
    assert_float32_product(y, x.astype(np.float32), reference)
    ones = block_linear(torch.ones((1, K), dtype=torch.int32), *tensors(weights), **layout(weights)).numpy()
    assert_float32_product(ones, np.ones((1, K), np.float32), reference)
    with pytest.raises(TypeError, match=r"block_gemv multiplies float32 x .* Received: x torch.float64"):
        block_gemv.block_gemv(torch.from_numpy(x), *tensors(weights), **layout(weights))


@pytest.mark.parametrize("rows", [1, 5])
def test_a_group_whose_weights_are_small_beside_its_offset_keeps_the_factored_bound(rows):
    """Q4_1 groups with d = 66.6875, m = -1000.5 and every q = 15: each weight is -0.1875, exactly, in
    float32 (gguf's dequantization). block_gemv sums s_g sum q x and o_g sum x apart, and 15 d and m
    cancel to 1 part in 5000: the error is float32's on those two sums (block_matmul's docstring),
    above the 1e-5 |x| |W| bound of the dequantize-then-GEMM path, which keeps it (probe-q)."""
    from attnkit.kernels.quantized import repack

    n, k = 4, 256
    blocks = np.zeros((n * k // 32, 20), np.uint8)  # Q4_1: d (float16), m (float16), 16 bytes of nibbles
    blocks[:, 0:2] = np.array([66.6875], np.float16).view(np.uint8)
    blocks[:, 2:4] = np.array([-1000.5], np.float16).view(np.uint8)
    blocks[:, 4:] = 0xFF
    raw = blocks.reshape(n, -1)
    reference = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).reshape(n, k).astype(np.float64)
    assert np.all(reference == -0.1875)
    weights = repack(raw, "Q4_1", (n, k))
    x = np.random.default_rng(0).standard_normal((rows, k)).astype(np.float32)
    y = block_gemv.block_gemv(torch.from_numpy(x), *tensors(weights), **layout(weights)).numpy()
    expected = x.astype(np.float64) @ reference.T
    terms = np.full((n, k), 66.6875 * 15 + 1000.5)  # |s_g q| + |o_g - s_g zero| per weight
    assert np.all(np.abs(y - expected) <= 1e-5 * (np.abs(x) @ terms.T) + 1e-6)
    wide = np.concatenate([x] * (block_gemv.MAX_ROWS // rows + 1))  # more rows: dequantize, then one GEMM
    y_wide = block_linear(torch.from_numpy(wide), *tensors(weights), **layout(weights)).numpy()
    assert_float32_product(y_wide, wide, reference)
