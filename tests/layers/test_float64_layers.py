"""float64 layers compute in float64 (docs/decisions.md item 17): against float64 NumPy references to
1e-12, where float32 arithmetic anywhere inside would be off by about 1e-7. On torch Keras computes
`keras.ops.mean` and `keras.ops.matmul` of float64 tensors in float32; jax has float64 only with
jax_enable_x64, which the suite leaves off."""

import numpy as np
import pytest
from backend_utils import BACKEND, to_numpy

import attnkit
from attnkit.layers.rms_norm import RMSNorm

float64 = pytest.mark.skipif(BACKEND == "jax", reason="jax computes float64 only with jax_enable_x64")


def inputs(rng, *shape):
    return rng.normal(size=shape) * 3 + 1  # float64, an offset the norms must remove exactly


@float64
def test_add_normalization(rng):
    x, sub = inputs(rng, 2, 5, 12), inputs(rng, 2, 5, 12)
    y = to_numpy(attnkit.AddNormalization(epsilon=0.5, dtype="float64")(x, sub))
    s = x + sub
    expected = (s - s.mean(-1, keepdims=True)) / np.sqrt(s.var(-1, keepdims=True) + 0.5)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, expected, rtol=0, atol=1e-12)


@float64
def test_rms_norm(rng):
    x = inputs(rng, 2, 5, 12)
    norm = RMSNorm(epsilon=0.5, dtype="float64")
    norm.build(x.shape)
    gamma = rng.normal(size=12)
    norm.gamma.assign(gamma)
    y = to_numpy(norm(x))
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, x / np.sqrt((x * x).mean(-1, keepdims=True) + 0.5) * gamma, rtol=0, atol=1e-12)


@float64
def test_additive_attention(rng):
    q, k, v = inputs(rng, 2, 3, 4), inputs(rng, 2, 5, 4), inputs(rng, 2, 5, 3)
    layer = attnkit.AdditiveAttention(8, dtype="float64")
    context, weights = layer(q, k, v)
    W_q, W_k, w_v = (to_numpy(d.kernel) for d in (layer.W_q, layer.W_k, layer.v))
    scores = (np.tanh((q @ W_q)[:, :, None] + (k @ W_k)[:, None]) @ w_v)[..., 0]  # (B, T_q, T_k)
    expected_weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected_weights /= expected_weights.sum(-1, keepdims=True)
    context, weights = to_numpy(context), to_numpy(weights)
    assert context.dtype == weights.dtype == np.float64
    np.testing.assert_allclose(weights, expected_weights, rtol=0, atol=1e-12)
    np.testing.assert_allclose(context, expected_weights @ v, rtol=0, atol=1e-12)


def test_rms_norm_refuses_integers():
    """Integers were normalized in integers: [[3, 4]] gave [[0, 1]] on torch and jax."""
    with pytest.raises(TypeError, match=r"`x` must be a floating-point tensor. Received: x with dtype=int"):
        RMSNorm()(np.array([[3, 4]]))
