"""Tests for FeedForward: exact values for relu and exact-erf gelu, errors, serialization."""

import math

import numpy as np
import pytest

import keras
from attnkit import FeedForward
from backend_utils import BACKEND
from encoder_checks import assert_close, config_round_trip, keras_file_round_trip, mixed_bfloat16_close

B, T, D, D_FF = 2, 5, 6, 10


def make_layer(rng, **kwargs):
    layer = FeedForward(D_FF, D, **kwargs)
    layer.build((None, None, D))
    weights = [
        rng.standard_normal((D, D_FF)).astype("float32"), rng.standard_normal(D_FF).astype("float32"),
        rng.standard_normal((D_FF, D)).astype("float32") / 3, rng.standard_normal(D).astype("float32"),
    ]
    layer.set_weights(weights)
    return layer, [w.astype("float64") for w in weights]


def erf_gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


@pytest.mark.parametrize("activation,fn", [("relu", lambda x: np.maximum(x, 0)), ("gelu", erf_gelu)])
def test_equals_two_linear_maps_around_the_activation(rng, activation, fn):
    layer, (w1, b1, w2, b2) = make_layer(rng, activation=activation)
    x = rng.standard_normal((B, T, D)).astype("float32")
    assert_close(layer(x), fn(x @ w1 + b1) @ w2 + b2, atol=1e-5)


def test_gelu_is_the_exact_erf_form_not_the_tanh_approximation(rng):
    layer, (w1, b1, w2, b2) = make_layer(rng, activation="gelu")
    x = rng.standard_normal((B, T, D)).astype("float32") * 3
    hidden = x @ w1 + b1
    tanh_gelu = 0.5 * hidden * (1 + np.tanh(math.sqrt(2 / math.pi) * (hidden + 0.044715 * hidden**3)))
    exact, approx = erf_gelu(hidden) @ w2 + b2, tanh_gelu @ w2 + b2
    assert np.abs(exact - approx).max() > 1e-4  # the test can tell the two apart
    assert_close(layer(x), exact, atol=1e-5)


@pytest.mark.skipif(BACKEND != "torch", reason="compares with torch.nn.functional.gelu on torch tensors")
def test_gelu_equals_torch_gelu(rng):
    import torch

    x = rng.standard_normal((B, T, D)).astype("float32") * 3
    layer = FeedForward(D_FF, D, activation="gelu")
    layer.build((None, None, D))
    k1, b1, k2, b2 = (torch.from_numpy(w) for w in layer.get_weights())
    xt = torch.from_numpy(x)
    want = torch.nn.functional.gelu(xt @ k1 + b1) @ k2 + b2
    assert_close(layer(x), want.numpy(), atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(d_ff=-1), r"`d_ff` must be a positive integer. Received: d_ff=-1"),
        (dict(d_ff=0), r"`d_ff` must be a positive integer. Received: d_ff=0"),
        (dict(d_model=1.5), r"`d_model` must be a positive integer. Received: d_model=1.5"),
        (dict(activation="tanh"), r"`activation` must be one of \('relu', 'gelu', 'gelu_tanh', 'silu'\). Received: activation='tanh'"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    args = dict(d_ff=D_FF, d_model=D)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        FeedForward(**args)


def test_output_width_is_d_model_for_any_input_width(rng):
    layer = FeedForward(D_FF, 3)
    x = rng.standard_normal((B, T, D)).astype("float32")
    assert tuple(layer(x).shape) == (B, T, 3) == layer.compute_output_shape(x.shape)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_config_and_keras_file_round_trips(rng, tmp_path, activation):
    layer, _ = make_layer(rng, activation=activation)
    x = rng.standard_normal((B, T, D)).astype("float32")
    config_round_trip(layer, x)
    inputs = keras.Input((None, D))
    model = keras.Model(inputs, FeedForward(D_FF, D, activation=activation)(inputs))
    keras_file_round_trip(model, x, tmp_path / "ff.keras")


def test_mixed_bfloat16_is_finite_and_close_to_float32(rng):
    x = rng.standard_normal((B, T, D)).astype("float32")
    mixed_bfloat16_close(lambda: FeedForward(D_FF, D, activation="gelu"), (x,), atol=0.1)
