"""Half-precision LayerNorm and RMSNorm on torch's CPU, normalized in float32 a chunk of rows at a
time (docs/decisions.md item 75): the same numbers as widening the whole input, close to float64,
exact on constant rows, and the whole input under autograd.

Legend: N rows, d the normalized width.
"""

import keras
import numpy as np
import pytest

from backend_utils import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="torch's own CPU kernels")

if BACKEND == "torch":
    import torch
    import torch.nn.functional as F

    from attnkit.layers._sublayer import call_layer_norm
    from attnkit import kernels as _fused
    from attnkit.kernels import norms

DTYPES = ["bfloat16", "float16"]


@pytest.fixture(autouse=True)
def on_the_cpu():
    with keras.device("cpu"):
        yield


def _hostile_input(rng, shape, dtype, layout):
    """(..., d) values with a large offset, a NaN, an inf and a constant row; "strided": not contiguous."""
    x = 40.0 + 3.0 * rng.standard_normal(shape)
    x[0, 1, 3], x[-1, -2, 0], x[0, 0, :] = np.nan, np.inf, 7.0
    x = torch.from_numpy(x).to(getattr(torch, dtype))
    if layout == "strided":  # the same values, rows no longer contiguous in memory
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
        assert not x.is_contiguous()
    return x


def _whole(x, gamma, beta, epsilon):
    return F.layer_norm(x.float(), x.shape[-1:], gamma, beta, epsilon).to(x.dtype)


def _counting(monkeypatch, name):
    calls = []
    original = getattr(F, name)

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(F, name, counted)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, layout", [((16, 128, 512), "contiguous"), ((3, 700, 384), "strided")])
def test_layer_norm_in_chunks_equals_the_whole_input_widened(rng, monkeypatch, dtype, shape, layout):
    x = _hostile_input(rng, shape, dtype, layout)
    gamma, beta = torch.from_numpy(rng.standard_normal(shape[-1]).astype("float32")), torch.randn(shape[-1])
    calls = _counting(monkeypatch, "layer_norm")
    with torch.no_grad():
        got = _fused.layer_norm(x, gamma, beta, 1e-6)
    rows_per_chunk = norms.NORM_CHUNK_BYTES // (4 * shape[-1])
    # Contiguous inputs run in chunks; others are widened whole.
    assert len(calls) == (-(-x[..., 0].numel() // rows_per_chunk) if layout == "contiguous" else 1) > 0
    assert len(calls) > 1 or layout != "contiguous"
    assert got.dtype == x.dtype and got.shape == x.shape
    want = _whole(x, gamma, beta, 1e-6)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # And close to float64: one rounding of the half-precision result (finite rows only).
    exact = F.layer_norm(x.double(), x.shape[-1:], gamma.double(), beta.double(), 1e-6)
    finite = torch.isfinite(exact).all(-1)
    assert (~finite).sum() == 2 and torch.isnan(got[~finite]).all()
    np.testing.assert_allclose(got[finite].double().numpy(), exact[finite].numpy(),
                               rtol=torch.finfo(x.dtype).eps, atol=torch.finfo(x.dtype).eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_rows_normalize_to_beta_exactly(dtype):
    # torch's mixed-dtype kernel computes x * rstd - mean * rstd: 0.066 instead of 0 here.
    x = torch.full((2048, 512), 3000.0 if dtype == "bfloat16" else 300.0, dtype=getattr(torch, dtype))
    gamma, beta = torch.ones(512), torch.linspace(-1, 1, 512)
    with torch.no_grad():
        got = _fused.layer_norm(x, gamma, beta, 1e-6)
    assert torch.equal(got, beta.to(x.dtype).expand(2048, 512))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_keras_layer_called_directly_equals_its_keras_call_without_autograd(rng, dtype):
    norm = keras.layers.LayerNormalization(dtype=f"mixed_{dtype}")
    norm.build((None, None, 384))
    for weight in norm.weights:
        weight.assign(rng.standard_normal(weight.shape))
    x = _hostile_input(rng, (4, 300, 384), dtype, "contiguous")
    with torch.no_grad():
        got, want = call_layer_norm(norm, x), norm(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_under_autograd_the_gradients_are_the_whole_inputs(rng, dtype):
    # torch's mixed-dtype backward sums beta's gradient with an error of 0.7 on 264 rows; these are exact.
    x0 = _hostile_input(rng, (4, 300, 384), dtype, "contiguous")
    x0[0, 1, 3] = x0[-1, -2, 0] = 1.0
    upstream = torch.from_numpy(rng.standard_normal(x0.shape)).to(x0.dtype)
    grads = []
    for norm in (_fused.layer_norm, _whole):
        x = x0.clone().requires_grad_()
        gamma, beta = torch.ones(384, requires_grad=True), torch.zeros(384, requires_grad=True)
        norm(x, gamma, beta, 1e-6).backward(upstream)
        grads.append((x.grad, gamma.grad, beta.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    np.testing.assert_allclose(grads[0][2].numpy(), upstream.double().sum((0, 1)).numpy(), rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_in_chunks_equals_the_whole_input_widened(rng, monkeypatch, dtype):
    x = _hostile_input(rng, (8, 256, 576), dtype, "contiguous")
    gamma = torch.from_numpy(rng.standard_normal(576)).to(x.dtype)
    calls = _counting(monkeypatch, "rms_norm")
    with torch.no_grad():
        got = _fused.rms_norm(x, gamma, 1e-5)
    assert len(calls) > 1
    want = gamma * F.rms_norm(x.float(), (576,), None, 1e-5).to(x.dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_one_chunk_or_less_is_one_call(monkeypatch):
    calls = _counting(monkeypatch, "layer_norm")
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        got = _fused.layer_norm(x, torch.ones(64), torch.zeros(64), 1e-5)
    assert calls == [3] and got.shape == x.shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_inputs_strided_along_the_normalized_axis_keep_the_whole_paths_numbers(rng, dtype):
    # torch's float32 RMSNorm of a strided input depends on its layout: 36 of 12.6M elements differed.
    x = torch.from_numpy(rng.standard_normal((4, 384, 2048))).to(getattr(torch, dtype)).transpose(1, 2)  # (4, 2048, 384)
    one = torch.ones(384, dtype=x.dtype)
    with torch.no_grad():
        got = _fused.rms_norm(x, one, 1e-6)
        norm = _fused.layer_norm(x, None, None, 1e-6)
    assert torch.equal(got, one * F.rms_norm(x.float(), (384,), None, 1e-6).to(x.dtype))
    assert torch.equal(norm, _whole(x, None, None, 1e-6)) and norm.stride() == _whole(x, None, None, 1e-6).stride()


def test_an_empty_normalized_axis_gives_an_empty_result():
    x = torch.zeros(5, 0, dtype=torch.bfloat16)
    with torch.no_grad():
        assert _fused.layer_norm(x, None, None, 1e-6).shape == (5, 0)
        assert _fused.rms_norm(x, torch.ones(0, dtype=torch.bfloat16), 1e-6).shape == (5, 0)


def test_under_vmap_a_sample_larger_than_a_chunk_is_normalized_whole(rng):
    x = torch.from_numpy(rng.standard_normal((3, 3000, 384))).to(torch.bfloat16)
    got = torch.func.vmap(lambda t: _fused.layer_norm(t, None, None, 1e-6))(x)
    assert torch.equal(got, _whole(x, None, None, 1e-6))
    gamma = torch.ones(384, dtype=torch.bfloat16)
    got = torch.func.vmap(lambda t: _fused.rms_norm(t, gamma, 1e-6))(x)
    assert torch.equal(got, gamma * F.rms_norm(x.float(), (384,), None, 1e-6).to(x.dtype))
