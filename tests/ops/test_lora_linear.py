"""LoRA's projection as one torch autograd Function (`kernels.lora_linear`, docs/decisions.md item 149):
outputs and every gradient against float64 NumPy, second derivatives against torch's own ops, the
cases it leaves to `keras.ops`, and a Dense with LoRA enabled equal to Keras's own arithmetic.

Legend: M rows, d_in / d_out widths, r rank.
"""

import keras
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend_utils import BACKEND, to_numpy

from attnkit import kernels
from attnkit.layers.linear import Linear

torch_only = pytest.mark.skipif(BACKEND != "torch", reason="the Function is torch's; XLA fuses the same sums")

if BACKEND == "torch":
    import torch


def _reference(x, kernel, bias, a, b, scale, upstream):
    """float64 (y, dy/dx, dy/dkernel, dy/dbias, dy/da, dy/db) of y = x kernel + bias + scale (x a) b."""
    x, kernel, a, b, upstream = (v.astype(np.float64) for v in (x, kernel, a, b, upstream))
    rows, g = x.reshape(-1, x.shape[-1]), upstream.reshape(-1, upstream.shape[-1])  # (M, d_in), (M, d_out)
    y = x @ kernel + (0 if bias is None else bias.astype(np.float64)) + scale * (x @ a) @ b
    grad_h = scale * g @ b.T  # (M, r)
    grad_x = (g @ kernel.T + grad_h @ a.T).reshape(x.shape)
    return y, grad_x, rows.T @ g, g.sum(0), rows.T @ grad_h, scale * (rows @ a).T @ g


@torch_only
@settings(max_examples=25, deadline=None)
@given(
    lead=st.sampled_from([(1,), (3,), (2, 5), (0,)]), d_in=st.integers(1, 9), d_out=st.integers(1, 9),
    rank=st.integers(1, 4), with_bias=st.booleans(), scale=st.sampled_from([2.0, 0.5, -1.25]),
    needs=st.sampled_from(["all", "lora", "lora and x", "lora, x and bias"]), seed=st.integers(0, 2**16),
)
def test_outputs_and_gradients_equal_float64(lead, d_in, d_out, rank, with_bias, scale, needs, seed):
    rng = np.random.default_rng(seed)
    x, kernel, a, b = (rng.standard_normal(s).astype("float32") for s in ((*lead, d_in), (d_in, d_out), (d_in, rank), (rank, d_out)))
    bias = rng.standard_normal(d_out).astype("float32") if with_bias else None
    upstream = rng.standard_normal((*lead, d_out)).astype("float32")
    xt, kt, at, bt = (torch.tensor(v, requires_grad=True) for v in (x, kernel, a, b))
    biast = None if bias is None else torch.tensor(bias, requires_grad=True)
    if needs != "all":  # LoRA's case: the kernel frozen, the bias too unless Dense's own enable_lora left it
        kt.requires_grad_(False), biast is not None and needs != "lora, x and bias" and biast.requires_grad_(False)
    if needs == "lora":  # the first layer: x is not in the graph
        xt.requires_grad_(False)
    y = kernels.lora_linear(xt, kt, biast, at, bt, scale)
    assert "LoRALinear" in type(y.grad_fn).__name__
    y.backward(torch.from_numpy(upstream))
    ref_y, ref_x, ref_k, ref_bias, ref_a, ref_b = _reference(x, kernel, bias, a, b, scale, upstream)
    tol = dict(rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(y.detach().numpy(), ref_y, **tol)
    np.testing.assert_allclose(at.grad.numpy(), ref_a, **tol)
    np.testing.assert_allclose(bt.grad.numpy(), ref_b, **tol)
    if needs == "lora":
        assert xt.grad is None
    else:
        np.testing.assert_allclose(xt.grad.numpy(), ref_x, **tol)
    if needs == "all":
        np.testing.assert_allclose(kt.grad.numpy(), ref_k, **tol)
    else:
        assert kt.grad is None
    if bias is not None and needs in ("all", "lora, x and bias"):
        np.testing.assert_allclose(biast.grad.numpy(), ref_bias, **tol)
    elif bias is not None:
        assert biast.grad is None


@torch_only
def test_expanded_upstream_gradient(rng):
    # A sum's gradient arrives with strides of 0.
    x, kernel, a, b = (torch.tensor(rng.standard_normal(s).astype("float32"), requires_grad=True) for s in ((4, 3, 6), (6, 5), (6, 2), (2, 5)))
    kernels.lora_linear(x, kernel, None, a, b, 2.0).sum().backward()
    _, ref_x, ref_k, _, ref_a, ref_b = _reference(*(to_numpy(t.detach()) for t in (x, kernel)), None,
                                                 *(to_numpy(t.detach()) for t in (a, b)), 2.0, np.ones((4, 3, 5), "float32"))
    for got, want in ((x.grad, ref_x), (kernel.grad, ref_k), (a.grad, ref_a), (b.grad, ref_b)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-4)


@torch_only
def test_second_derivatives_equal_torchs(rng):
    leaves = [torch.tensor(rng.standard_normal(s), requires_grad=True) for s in ((5, 4), (4, 3), (3,), (4, 2), (2, 3))]
    theirs = [t.detach().clone().requires_grad_(True) for t in leaves]
    for (x, kernel, bias, a, b), function in ((leaves, kernels.lora_linear), (theirs, None)):
        y = function(x, kernel, bias, a, b, 0.75) if function else x @ kernel + bias + (x @ a) @ b * 0.75
        first = torch.autograd.grad(y.pow(3).sum(), (x, a, b), create_graph=True)
        sum(g.pow(2).sum() for g in first).backward()
    assert "LoRALinear" in type(kernels.lora_linear(*leaves, 0.75).grad_fn).__name__
    for ours, ref in zip(leaves, theirs):
        torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-9, atol=1e-9)


@torch_only
def test_operands_it_leaves_to_keras_ops():
    f32 = lambda *s: torch.ones(*s)  # noqa: E731
    assert kernels.lora_linear(f32(2, 3).bfloat16(), f32(3, 4).bfloat16(), None, f32(3, 2), f32(2, 4), 1.0) is None
    assert kernels.lora_linear(f32(2, 3).half(), f32(3, 4).half(), None, f32(3, 2).half(), f32(2, 4).half(), 1.0) is None
    assert kernels.lora_linear(f32(2, 5), f32(3, 4), None, f32(3, 2), f32(2, 4), 1.0) is None  # x's width
    assert kernels.lora_linear(f32(2, 3), f32(3, 4), None, f32(3, 2), f32(3, 4), 1.0) is None  # rank mismatch
    assert kernels.lora_linear(f32(2, 3), f32(3, 4), f32(5), f32(3, 2), f32(2, 4), 1.0) is None  # bias width
    assert kernels.lora_linear(np.ones((2, 3), "float32"), f32(3, 4), None, f32(3, 2), f32(2, 4), 1.0) is None
    assert kernels.lora_linear(f32(2, 0), f32(0, 4), None, f32(0, 2), f32(2, 4), 1.0) is None  # no input width
    assert kernels.lora_linear(f32(2, 3), f32(3, 0), None, f32(3, 2), f32(2, 0), 1.0) is None  # no output width
    assert kernels.lora_linear(f32(2, 3), f32(3, 4), None, f32(3, 2), f32(2, 4), 0.0) is None  # NaNs in A B kept
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts each product itself
        assert kernels.lora_linear(f32(2, 3), f32(3, 4), None, f32(3, 2), f32(2, 4), 1.0) is None


def test_a_lora_dense_equals_keras_arithmetic(rng):
    """On every backend: Linear with LoRA gives x W + b + (alpha / r) (x A) B and its gradients as
    Keras's own ops compute them (float32 within rounding)."""
    layer = Linear(6, use_bias=True)
    layer.build((None, 5))
    layer.bias.assign(rng.standard_normal(6).astype("float32"))
    layer.enable_lora(3, lora_alpha=4, a_initializer="glorot_uniform")
    layer.lora_kernel_b.assign(rng.standard_normal((3, 6)).astype("float32"))
    x = rng.standard_normal((2, 4, 5)).astype("float32")
    kernel, bias, a, b = (to_numpy(v) for v in (layer._kernel, layer.bias, layer.lora_kernel_a, layer.lora_kernel_b))
    np.testing.assert_allclose(to_numpy(layer(x)), _reference(x, kernel, bias, a, b, 4 / 3, np.zeros((2, 4, 6), "float32"))[0], rtol=1e-5, atol=1e-5)
    if BACKEND == "torch":
        xt = torch.tensor(x, requires_grad=True)
        y = layer(xt)
        assert "LoRALinear" in type(y.grad_fn).__name__
        upstream = rng.standard_normal((2, 4, 6)).astype("float32")
        y.backward(torch.from_numpy(upstream))
        _, ref_x, _, _, ref_a, ref_b = _reference(x, kernel, bias, a, b, 4 / 3, upstream)
        np.testing.assert_allclose(xt.grad.numpy(), ref_x, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(to_numpy(layer.lora_kernel_a.value.grad), ref_a, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(to_numpy(layer.lora_kernel_b.value.grad), ref_b, rtol=1e-5, atol=1e-5)
        assert layer._kernel.value.grad is None  # frozen by enable_lora
