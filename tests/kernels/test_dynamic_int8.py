"""`kernels.quantized.dynamic_int8` (docs/decisions.md item 141): int8 products with the input quantized
per call, against a float64 NumPy reference of the formula, on every backend (torch's CPU runs fbgemm's
kernel, the others the formula in keras ops); the error bound against the float product; non-finite
inputs; the gradient; a weight changed in place."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from backend_utils import BACKEND, to_numpy, value_and_grads
from keras import ops

from attnkit.kernels.quantized import block_linear, dynamic_int8
from attnkit.kernels.quantized.weight_only import quantize_int8


def reference(x, blocks, bias=None):
    """The module docstring's formula in float64: (y, each row's step (..., 1), W)."""
    x = x.astype(np.float64)
    m = np.abs(x).max(axis=-1, keepdims=True)
    step = np.where(m > 0, m / 63, 1.0)
    q = np.round(x / step)
    w = blocks.values.astype(np.float64) * blocks.scale.astype(np.float64)  # (N, K)
    y = (q * step) @ w.T
    return (y if bias is None else y + bias), step, w


def product(x, blocks, bias=None):
    values, scale = ops.convert_to_tensor(blocks.values), ops.convert_to_tensor(blocks.scale)
    b = None if bias is None else ops.convert_to_tensor(bias)
    return to_numpy(block_linear(ops.convert_to_tensor(x), values, scale, None, b, bits=8, zero=0, group=blocks.shape[1],
                                 shape=blocks.shape, activations="int8"))


def _within(y, expected, x, w, step, ties=2):
    """y within `ties` steps of the formula on the largest weights, plus float32's rounding: an element
    on a .5 boundary may round either way in float32 arithmetic (fbgemm's, or keras ops')."""
    ties = np.sort(np.abs(w), axis=1)[:, -ties:].sum(axis=1)  # (N,)
    tolerance = step * ties + 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(w).T) + 1e-30
    assert np.all(np.abs(y - expected) <= tolerance), np.abs(y - expected).max()


def test_matches_the_formula_and_stays_within_the_rounding_bound():
    rng = np.random.default_rng(0)
    weights = rng.normal(size=(48, 64)).astype(np.float32)
    x = rng.normal(size=(3, 5, 64)).astype(np.float32)
    bias = rng.normal(size=48).astype(np.float32)
    blocks = quantize_int8(weights)
    y = product(x, blocks, bias)
    expected, step, w = reference(x, blocks, bias)
    assert y.shape == (3, 5, 48) and y.dtype == np.float32
    _within(y, expected, x, w, step)
    # against the float product of the float weights: half a step of x per weight, plus W's rounding
    exact = x.astype(np.float64) @ weights.T.astype(np.float64) + bias
    bound = 0.5 * step * np.abs(weights).sum(axis=1) + np.abs(x.astype(np.float64)) @ np.abs(w - weights).T + 1e-4
    assert np.all(np.abs(y - exact) <= bound)
    assert np.abs(y - exact).max() > 1e-4  # the input really was rounded: this is not the float product


@settings(max_examples=30, deadline=None)
@given(
    arrays(np.float32, st.tuples(st.integers(1, 6), st.sampled_from([8, 32, 40])), elements=st.floats(-50, 50, width=32)),
    st.integers(1, 9),
)
def test_any_input_matches_the_formula(x, n):
    weights = np.random.default_rng(n).normal(size=(n, x.shape[1])).astype(np.float32)
    blocks = quantize_int8(weights)
    expected, step, w = reference(x, blocks)
    _within(product(x, blocks), expected, x, w, step, ties=x.shape[1])  # a row may be all ties (hypothesis finds them)


def test_zeros_one_signed_and_narrow_inputs():
    blocks = quantize_int8(np.random.default_rng(1).normal(size=(4, 16)).astype(np.float32))
    assert np.all(product(np.zeros((2, 16), np.float32), blocks) == 0)
    for low, high in ((-3, -1), (1, 3), (-1e-4, 2e-4), (1e-30, 3e-30), (-4e3, -1e3)):
        x = np.linspace(low, high, 32, dtype=np.float32).reshape(2, 16)
        expected, step, w = reference(x, blocks)
        _within(product(x, blocks), expected, x, w, step)


def test_non_finite_input_is_the_float_product():
    blocks = quantize_int8(np.random.default_rng(2).normal(size=(4, 8)).astype(np.float32))
    x = np.ones((2, 8), np.float32)
    x[0, 3] = np.inf
    x[1, 0] = np.nan
    y = product(x, blocks)
    w = blocks.values.astype(np.float32) * blocks.scale
    with np.errstate(invalid="ignore"):
        expected = x @ w.T
    np.testing.assert_array_equal(np.isnan(y), np.isnan(expected))
    np.testing.assert_array_equal(y[np.isinf(expected)], expected[np.isinf(expected)])
    assert np.isnan(y[1]).all()


def test_gradient_is_the_float_products():
    rng = np.random.default_rng(3)
    blocks = quantize_int8(rng.normal(size=(6, 16)).astype(np.float32))
    x = rng.normal(size=(4, 16)).astype(np.float32)
    values, scale = ops.convert_to_tensor(blocks.values), ops.convert_to_tensor(blocks.scale)
    y, (grad,) = value_and_grads(lambda t: dynamic_int8.linear(t, values, scale), x)
    expected, step, w = reference(x, blocks)
    _within(y, expected, x, w, step)
    np.testing.assert_allclose(grad, np.broadcast_to(w.sum(axis=0), x.shape), rtol=1e-5, atol=1e-5)


def _torch_operands(seed):
    """(blocks, values, scale, x) as torch tensors: int8 weights (6, 16) and x (3, 16)."""
    import torch

    rng = np.random.default_rng(seed)
    blocks = quantize_int8(rng.normal(size=(6, 16)).astype(np.float32))
    return blocks, torch.tensor(blocks.values), torch.tensor(blocks.scale), torch.tensor(rng.normal(size=(3, 16)).astype(np.float32))


@pytest.mark.skipif(BACKEND != "torch", reason="the packed weight kept between calls is torch's")
def test_a_weight_changed_in_place_is_seen():
    import torch

    _, values, scale, x = _torch_operands(4)
    with torch.no_grad():
        first = dynamic_int8.linear(x, values, scale)
        values.neg_()
        scale.mul_(2)
        second = dynamic_int8.linear(x, values, scale)
    np.testing.assert_allclose(second.numpy(), -2 * first.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(BACKEND != "torch", reason="the packed weight kept between calls is torch's")
def test_new_data_under_the_same_tensor_is_seen_and_inference_tensors_are_taken():
    import torch

    blocks, values, scale, x = _torch_operands(6)
    with torch.no_grad():
        first = dynamic_int8.linear(x, values, scale)
        values.data = (-values).clone()  # as Module.to and vector_to_parameters assign: no version bump
        np.testing.assert_allclose(dynamic_int8.linear(x, values, scale).numpy(), -first.numpy(), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        frozen_values, frozen_scale = torch.tensor(blocks.values), torch.tensor(blocks.scale)
        np.testing.assert_allclose(dynamic_int8.linear(x, frozen_values, frozen_scale).numpy(), first.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(BACKEND != "torch", reason="fbgemm is torch's kernel")
def test_torch_runs_fbgemm_and_another_engine_runs_the_formula(monkeypatch):
    import torch

    rng = np.random.default_rng(7)
    blocks = quantize_int8(rng.normal(size=(8, 32)).astype(np.float32))
    x = rng.normal(size=(5, 32)).astype(np.float32)
    expected, step, w = reference(x, blocks)
    kernel, calls = torch.ops.quantized.linear_dynamic, []
    monkeypatch.setattr(torch.ops.quantized, "linear_dynamic", lambda *a: calls.append(1) or kernel(*a))
    with torch.no_grad():
        _within(product(x, blocks), expected, x, w, step)
        assert calls == [1]
        monkeypatch.setattr(torch.backends.quantized, "engine", "qnnpack")  # requantizes otherwise: 1-3% off
        _within(product(x, blocks), expected, x, w, step)
        assert calls == [1]


def test_empty_inputs_and_huge_rows():
    blocks = quantize_int8(np.random.default_rng(8).normal(size=(4, 8)).astype(np.float32))
    bias = np.arange(4, dtype=np.float32)
    assert product(np.zeros((0, 8), np.float32), blocks, bias).shape == (0, 4)
    assert product(np.zeros((2, 0, 8), np.float32), blocks).shape == (2, 0, 4)
    x = np.zeros((2, 8), np.float32)
    x[0, 0], x[0, 1], x[1] = 3.38e38, 1e37, 1.0  # the first row's scale overflows float32: no NaN for it
    y = product(x, blocks)
    expected, step, w = reference(x, blocks)
    assert not np.isnan(y).any()
    overflow = np.abs(expected) > np.finfo(np.float32).max  # float32 arithmetic gives these as infinities
    np.testing.assert_array_equal(np.isinf(y), overflow)
    np.testing.assert_array_equal(np.sign(y[overflow]), np.sign(expected[overflow]))
    _within(y[1:], expected[1:], x[1:], w, step[1:])
    assert np.all(np.abs(y[0] - expected[0])[~overflow[0]] <= 1e-5 * np.abs(x[0].astype(np.float64)) @ np.abs(w).T[:, ~overflow[0]] + step[0] * np.abs(w[~overflow[0]]).sum(1))


def test_refuses_blocks_that_are_not_per_row_int8():
    with pytest.raises(ValueError, match="int8 activations need per-row int8 weights"):
        block_linear(ops.ones((1, 64)), ops.zeros((2, 32), "uint8"), ops.ones((2, 2)), ops.zeros((2, 2)), bits=4, zero=0,
                     group=32, shape=(2, 64), activations="int8")
    with pytest.raises(ValueError, match="`activations` must be None, 'int8' or 'q8'. Received: activations='int4'"):
        block_linear(ops.ones((1, 4)), ops.zeros((2, 4), "int8"), ops.ones((2, 1)), None, bits=8, zero=0, group=4,
                     shape=(2, 4), activations="int4")


@settings(max_examples=20, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(2, 6), st.just(32)), elements=st.floats(-50, 50, width=32)))
def test_a_row_does_not_depend_on_the_others(x):
    """Each row has its own scale: a sentence's tokens come out the same whatever the batch holds."""
    blocks = quantize_int8(np.random.default_rng(5).normal(size=(8, 32)).astype(np.float32))
    together = product(x, blocks)
    for i in range(x.shape[0]):
        # float32 GEMMs of other row counts may sum in another order (jax, tensorflow): their rounding only
        np.testing.assert_allclose(together[i], product(x[i : i + 1], blocks)[0], rtol=1e-6, atol=1e-6 * np.abs(together).max())
