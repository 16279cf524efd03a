"""RMSNorm, SwiGLU, Residual and grouped-query MultiHeadAttention against float64 NumPy references."""

import keras
import numpy as np
import pytest
from backend_utils import to_numpy
from layer_harness import check_config_round_trip
from reference import attention as np_attention

from attnkit.layers.multi_head_attention import MultiHeadAttention
from attnkit.layers.residual import Residual
from attnkit.layers.rms_norm import RMSNorm
from attnkit.layers.swiglu import SwiGLUFeedForward


def np_rms_norm(x, gamma, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * gamma


def test_rms_norm_reference(rng):
    x = rng.standard_normal((2, 3, 8)) * 3
    norm = RMSNorm(epsilon=1e-5)
    norm.build(x.shape)
    gamma = rng.standard_normal(8)
    norm.gamma.assign(gamma)
    np.testing.assert_allclose(to_numpy(norm(x.astype("float32"))), np_rms_norm(x, gamma, 1e-5), atol=1e-5)


def test_rms_norm_bfloat16_keeps_dtype(rng):
    norm = RMSNorm(dtype="bfloat16")
    out = norm(rng.standard_normal((1, 2, 8)).astype("float32"))
    assert keras.backend.standardize_dtype(out.dtype) == "bfloat16"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "mixed_bfloat16", "mixed_float16"])
def test_rms_norm_half_precision_normalizes_in_float32_then_scales_in_its_dtype(rng, dtype):
    """What the layer computes in half precision: x normalized in float32, rounded once to the compute
    dtype, times gamma in that dtype. The fused torch path must round where the ops path rounds."""
    x = (rng.standard_normal((2, 3, 64)) * 3).astype("float32")
    gamma = rng.standard_normal(64)
    norm = RMSNorm(epsilon=1e-5, dtype=dtype)
    norm.build(x.shape)
    norm.gamma.assign(gamma)
    half = lambda a: to_numpy(keras.ops.cast(keras.ops.cast(a, norm.compute_dtype), "float32")).astype("float64")
    x_half = half(x)  # the input as the layer receives it
    normed = x_half / np.sqrt(np.mean(x_half**2, axis=-1, keepdims=True) + 1e-5)
    expected = half(half(gamma) * half(normed))  # one rounding for the normalized x, one for the product
    out = to_numpy(keras.ops.cast(norm(x), "float32"))
    assert keras.backend.standardize_dtype(norm(x).dtype) == norm.compute_dtype
    tolerance = 1e-2 if "bfloat16" in dtype else 1e-3  # a few units in the last place of each
    np.testing.assert_allclose(out, expected, rtol=tolerance, atol=tolerance)


def test_rms_norm_refusals():
    with pytest.raises(ValueError, match="epsilon"):
        RMSNorm(epsilon=0)
    norm = RMSNorm()
    norm.build((None, 4))
    with pytest.raises(ValueError, match="last dimension 4"):
        norm(np.zeros((1, 3), "float32"))


def test_swiglu_reference(rng):
    x = rng.standard_normal((2, 3, 6))
    ffn = SwiGLUFeedForward(d_ff=10, d_model=6)
    ffn.build(x.shape)
    gate, up, down = (to_numpy(d.kernel).astype("float64") for d in (ffn.W_gate, ffn.W_up, ffn.W_down))
    g = x @ gate
    expected = ((g / (1 + np.exp(-g))) * (x @ up)) @ down
    np.testing.assert_allclose(to_numpy(ffn(x.astype("float32"))), expected, atol=1e-5)
    assert ffn.get_config()["d_ff"] == 10 and ffn.W_gate.bias is None


def test_residual_both_arrangements(rng):
    x = rng.standard_normal((2, 3, 6)).astype("float32")
    ffn = SwiGLUFeedForward(d_ff=8, d_model=6)
    ffn.build(x.shape)
    f = lambda t: ffn(t)  # noqa: E731
    pre, post = Residual(RMSNorm(), norm_first=True), Residual(RMSNorm(), norm_first=False)
    out_pre, out_post = to_numpy(pre(x, sublayer=f)), to_numpy(post(x, sublayer=f))
    normed = np_rms_norm(x, 1.0, 1e-6).astype("float32")
    np.testing.assert_allclose(out_pre, x + to_numpy(ffn(normed)), atol=1e-5)
    np.testing.assert_allclose(out_post, np_rms_norm(x + to_numpy(ffn(x)), 1.0, 1e-6), atol=1e-5)
    config = pre.get_config()
    clone = Residual.from_config(config)
    assert clone.norm_first and isinstance(clone.norm, RMSNorm)
    check_config_round_trip(pre, (x,), {"sublayer": f})


def test_residual_dropout_only_in_training(rng):
    x = rng.standard_normal((2, 50, 6)).astype("float32")
    block = Residual(RMSNorm(), norm_first=True, dropout=0.5, seed=1)
    ones = lambda t: keras.ops.ones_like(t)  # noqa: E731
    np.testing.assert_allclose(to_numpy(block(x, sublayer=ones)), x + 1, atol=1e-6)
    dropped = to_numpy(block(x, sublayer=ones, training=True)) - x
    assert set(np.round(np.unique(dropped), 4)) <= {0.0, 2.0} and (dropped == 0).any()


def test_residual_refusals(rng):
    block = Residual(RMSNorm())
    with pytest.raises(TypeError, match="callable"):
        block(np.zeros((1, 2, 3), "float32"), sublayer=3)
    with pytest.raises(ValueError, match="shape of its input"):
        block(np.zeros((1, 2, 3), "float32"), sublayer=lambda t: t[..., :2])
    with pytest.raises(TypeError, match="`norm` must be a Keras layer"):
        Residual("rms")


@pytest.mark.parametrize("h,h_kv", [(6, 2), (4, 1)])
def test_mha_grouped_query_reference(rng, h, h_kv):
    d_k, d_model = 4, 12
    layer = MultiHeadAttention(h=h, d_k=d_k, d_v=d_k, d_model=d_model, num_kv_heads=h_kv)
    x = rng.standard_normal((2, 5, d_model))
    layer.build(x.shape)
    assert tuple(layer.W_k.kernel.shape) == (d_model, h_kv * d_k)
    W = {n: (to_numpy(getattr(layer, n).kernel).astype("float64"), to_numpy(getattr(layer, n).bias)) for n in ("W_q", "W_k", "W_v", "W_o")}

    def split(y, heads):
        return y.reshape(2, 5, heads, d_k).transpose(0, 2, 1, 3)

    q = split(x @ W["W_q"][0] + W["W_q"][1], h)
    k = np.repeat(split(x @ W["W_k"][0] + W["W_k"][1], h_kv), h // h_kv, axis=1)
    v = np.repeat(split(x @ W["W_v"][0] + W["W_v"][1], h_kv), h // h_kv, axis=1)
    keep = np.tril(np.ones((5, 5), bool))
    heads, weights = np_attention(q, k, v, keep)
    expected = heads.transpose(0, 2, 1, 3).reshape(2, 5, -1) @ W["W_o"][0] + W["W_o"][1]
    np.testing.assert_allclose(to_numpy(layer(x.astype("float32"), causal=True)), expected, atol=2e-5)
    out, w = layer(x.astype("float32"), causal=True, return_attention_weights=True)
    np.testing.assert_allclose(to_numpy(w), weights, atol=2e-5)
    assert MultiHeadAttention.from_config(layer.get_config()).num_kv_heads == h_kv


def test_mha_num_kv_heads_refusals():
    with pytest.raises(ValueError, match="`num_kv_heads` must divide `h`"):
        MultiHeadAttention(h=6, d_k=4, d_v=4, d_model=8, num_kv_heads=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiHeadAttention(h=6, d_k=4, d_v=4, d_model=8, num_kv_heads=0)
