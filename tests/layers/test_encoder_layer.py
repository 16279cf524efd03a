"""Tests for EncoderLayer: parity with torch.nn.TransformerEncoderLayer, masks, dropout, serialization."""

import numpy as np
import pytest

import keras
from attnkit import EncoderLayer
from attnkit.layers._keras_mask import keras_mask_of
from backend_utils import BACKEND, to_numpy
from encoder_checks import (
    assert_close, config_round_trip, fit_lowers_loss, keras_file_round_trip, mixed_bfloat16_close,
    torch_encoder_layer_like,
)

B, T, H, D, D_FF = 3, 7, 4, 16, 32
LENGTHS = (7, 4, 2)  # real tokens per sequence; the rest is padding


def make_layer(rate=0.0, **kwargs):
    return EncoderLayer(H, D // H, D // H, D, D_FF, rate, **kwargs)


def padding(lengths=LENGTHS, t=T):
    return np.arange(t)[None, :] < np.array(lengths)[:, None]  # (B, T), True at real tokens


def inputs(rng, t=T):
    return rng.standard_normal((B, t, D)).astype("float32")


@pytest.mark.skipif(BACKEND != "torch", reason="torch.nn.TransformerEncoderLayer needs the torch backend")
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "padding"])
def test_equals_torch_transformer_encoder_layer(rng, norm_first, activation, with_mask):
    import torch

    layer = make_layer(norm_first=norm_first, activation=activation, epsilon=1e-5)
    theirs = torch_encoder_layer_like(layer, rng)
    x, keep = inputs(rng), padding()
    with torch.no_grad():
        want = theirs(torch.from_numpy(x), src_key_padding_mask=torch.from_numpy(~keep) if with_mask else None)
    got = to_numpy(layer(x, keep if with_mask else None))
    want = want.numpy()
    if with_mask:  # torch's fast path may leave padding positions as zeros; compare real tokens
        got, want = got[keep], want[keep]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_attention_weights_have_heads_and_ignore_padding(rng):
    layer = make_layer()
    x, keep = inputs(rng), padding()
    out, weights = layer(x, keep, return_attention_weights=True)
    weights = to_numpy(weights)
    assert weights.shape == (B, H, T, T)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    assert np.all(weights[~np.broadcast_to(keep[:, None, None, :], weights.shape)] == 0)
    assert_close(out, layer(x, keep), atol=1e-5)  # explicit and fused paths agree


def test_appended_padding_does_not_change_real_tokens(rng):
    layer = make_layer()
    x = inputs(rng, t=4)
    short = to_numpy(layer(x, np.ones((B, 4), bool)))
    padded_x = np.concatenate([x, rng.standard_normal((B, 3, D)).astype("float32")], axis=1)
    padded = to_numpy(layer(padded_x, padding((4, 4, 4), t=7)))
    np.testing.assert_allclose(padded[:, :4], short, atol=1e-6)


def test_keras_mask_from_embedding_equals_explicit_mask(rng):
    ids = rng.integers(1, 20, (B, T))
    ids[~padding()] = 0
    embedding = keras.layers.Embedding(20, D, mask_zero=True)
    x = embedding(ids)
    assert keras_mask_of(x) is not None
    layer = make_layer()
    explicit = layer(x, padding())
    assert_close(layer(x), explicit, atol=1e-6)
    inputs_ = keras.Input((T,), dtype="int32")
    model = keras.Model(inputs_, layer(keras.layers.Embedding(20, D, mask_zero=True)(inputs_)))
    model.layers[1].set_weights(embedding.get_weights())
    assert_close(model(ids), explicit, atol=1e-6)


def test_integer_padding_mask_equals_boolean(rng):
    layer, x = make_layer(), inputs(rng)
    assert_close(layer(x, padding().astype("int32")), layer(x, padding()), atol=0)


def test_dropout_changes_outputs_only_in_training(rng):
    layer, x = make_layer(rate=0.3), inputs(rng)
    inference = to_numpy(layer(x))
    np.testing.assert_array_equal(to_numpy(layer(x, training=False)), inference)
    np.testing.assert_array_equal(to_numpy(layer(x)), inference)
    training = to_numpy(layer(x, None, True))  # the seeds' positional call
    assert np.abs(training - inference).max() > 1e-3


def test_zero_rate_training_equals_inference(rng):
    layer, x = make_layer(rate=0.0), inputs(rng)
    assert_close(layer(x, training=True), layer(x), atol=0)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(h=0), r"`h` must be a positive integer. Received: h=0"),
        (dict(d_ff=-1), r"`d_ff` must be a positive integer. Received: d_ff=-1"),
        (dict(rate=1.0), r"`rate` must be a float in \[0, 1\). Received: rate=1.0"),
        (dict(activation="swish"), r"`activation` must be one of \('relu', 'gelu', 'gelu_tanh', 'silu'\). Received: activation='swish'"),
        (dict(epsilon=0.0), r"`epsilon` must be a finite positive number. Received: epsilon=0.0"),
    ],
)
def test_bad_constructor_arguments_raise(kwargs, message):
    args = dict(h=H, d_k=4, d_v=4, d_model=D, d_ff=D_FF, rate=0.1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        EncoderLayer(**args)


def test_bad_inputs_raise(rng):
    layer, x = make_layer(), inputs(rng)
    with pytest.raises(ValueError, match=r"`x` must have shape \(batch, length, d_model=16\). Received: x.shape=\(3, 7, 8\)"):
        layer(x[..., :8])
    with pytest.raises(ValueError, match=r"`padding_mask` of shape \(3, 6\) does not broadcast to the attention scores of shape \(3, None, 7, 7\)"):
        layer(x, padding()[:, :6])
    with pytest.raises(TypeError, match=r"`padding_mask` must be a boolean or integer mask, not float32"):
        layer(x, padding().astype("float32"))


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_config_and_keras_file_round_trips(rng, tmp_path, norm_first):
    layer, x = make_layer(rate=0.1, norm_first=norm_first, activation="gelu", epsilon=1e-5), inputs(rng)
    config_round_trip(layer, x, padding())
    tokens = keras.Input((T, D))
    keep = keras.Input((T,), dtype="bool")
    model = keras.Model([tokens, keep], make_layer(norm_first=norm_first)(tokens, keep))
    keras_file_round_trip(model, [x, padding()], tmp_path / "encoder_layer.keras")


def test_compute_output_shape_matches_call(rng):
    layer, x = make_layer(), inputs(rng)
    assert tuple(layer(x).shape) == layer.compute_output_shape(x.shape)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_mixed_bfloat16_is_finite_and_close_to_float32(rng, norm_first):
    x = inputs(rng)
    mixed_bfloat16_close(lambda: make_layer(norm_first=norm_first), (x, padding()), atol=0.1)


def test_fit_step_lowers_the_loss(rng):
    tokens = keras.Input((T, D))
    model = keras.Model(tokens, make_layer(rate=0.1)(tokens))
    x = inputs(rng)
    fit_lowers_loss(model, x, np.tanh(x[..., ::-1]).copy())
