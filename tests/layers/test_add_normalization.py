"""Tests for AddNormalization: LayerNorm(x + sublayer_x) with the configured epsilon."""

import numpy as np
import pytest

import keras
from attnkit import AddNormalization
from encoder_checks import assert_close, config_round_trip, keras_file_round_trip, mixed_bfloat16_close

B, T, D = 2, 5, 6


def layer_norm(x, gamma, beta, epsilon):
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + epsilon) * gamma + beta


def test_equals_layer_norm_of_the_sum(rng):
    layer = AddNormalization()
    x, s = (rng.standard_normal((B, T, D)).astype("float32") for _ in range(2))
    layer(x, s)
    gamma, beta = rng.standard_normal(D).astype("float32"), rng.standard_normal(D).astype("float32")
    layer.layer_norm.set_weights([gamma, beta])
    assert_close(layer(x, s), layer_norm(x + s, gamma, beta, 1e-6), atol=1e-5)


@pytest.mark.parametrize("epsilon", [1e-6, 1e-2])
def test_epsilon_is_used(rng, epsilon):
    x = (rng.standard_normal((B, T, D)) * 0.05).astype("float32")  # small variance: epsilon matters
    zeros = np.zeros_like(x)
    want = layer_norm(x, 1.0, 0.0, epsilon)
    other_epsilon = 1e-2 if epsilon == 1e-6 else 1e-6
    assert np.abs(want - layer_norm(x, 1.0, 0.0, other_epsilon)).max() > 1e-2  # the test can tell them apart
    assert_close(AddNormalization(epsilon=epsilon)(x, zeros), want, atol=1e-4)


def test_shapes_that_cannot_be_added_raise(rng):
    x = rng.standard_normal((B, T, D)).astype("float32")
    with pytest.raises(ValueError, match=r"`x` and `sublayer_x` must have the same shape to be added. Received: x.shape=\(2, 5, 6\), sublayer_x.shape=\(2, 4, 6\)"):
        AddNormalization()(x, x[:, :4])


@pytest.mark.parametrize("epsilon", [0, -1e-6, float("nan")])
def test_bad_epsilon_raises(epsilon):
    with pytest.raises(ValueError, match=r"`epsilon` must be a finite positive number. Received: epsilon="):
        AddNormalization(epsilon=epsilon)


def test_config_and_keras_file_round_trips(rng, tmp_path):
    x, s = (rng.standard_normal((B, T, D)).astype("float32") for _ in range(2))
    config_round_trip(AddNormalization(epsilon=1e-5), x, s)
    a, b = keras.Input((None, D)), keras.Input((None, D))
    model = keras.Model([a, b], AddNormalization(epsilon=1e-5)(a, b))
    keras_file_round_trip(model, [x, s], tmp_path / "add_norm.keras")


def test_mixed_bfloat16_is_finite_and_close_to_float32(rng):
    x, s = (rng.standard_normal((B, T, D)).astype("float32") for _ in range(2))
    mixed_bfloat16_close(AddNormalization, (x, s), atol=0.05)
