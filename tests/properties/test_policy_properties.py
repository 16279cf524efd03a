"""Dtype policies (issue 17, class 4): a policy given to any public layer or model reaches every
sub-layer, and a `.keras` round trip gives the same numbers whatever the global policy at load time."""

import os

import keras
import numpy as np
import pytest

import attnkit
from backend_utils import to_numpy

POLICIES = ["float32", "mixed_float16", "mixed_bfloat16"]
RNG = np.random.default_rng(7)
X = RNG.standard_normal((2, 3, 8)).astype("float32")
IDS = np.array([[3, 4, 1, 0], [5, 6, 7, 2]], np.int32)

# name: (factory(dtype), inputs)
LAYERS = {
    "MultiHeadAttention": (lambda dtype: attnkit.MultiHeadAttention(2, 4, 4, 8, dtype=dtype), (X,)),
    "DotProductAttention": (lambda dtype: attnkit.DotProductAttention(dtype=dtype), (X, X, X)),
    "AdditiveAttention": (lambda dtype: attnkit.AdditiveAttention(4, dtype=dtype), (X, X, X)),
    "FeedForward": (lambda dtype: attnkit.FeedForward(16, 8, dtype=dtype), (X,)),
    "AddNormalization": (lambda dtype: attnkit.AddNormalization(dtype=dtype), (X, X)),
    "Linear": (lambda dtype: attnkit.Linear(5, dtype=dtype), (X,)),
    "SinusoidalPositionEncoding": (lambda dtype: attnkit.SinusoidalPositionEncoding(5, 8, dtype=dtype), (X,)),
    "PositionEmbeddingFixedWeights": (lambda dtype: attnkit.PositionEmbeddingFixedWeights(4, 9, 8, dtype=dtype), (IDS,)),
    "EncoderLayer": (lambda dtype: attnkit.EncoderLayer(2, 4, 4, 8, 16, 0.0, dtype=dtype), (X,)),
    "DecoderLayer": (lambda dtype: attnkit.DecoderLayer(2, 4, 4, 8, 16, 0.0, dtype=dtype), (X, X)),
    "Encoder": (lambda dtype: attnkit.Encoder(9, 4, 2, 4, 4, 8, 16, 2, 0.0, dtype=dtype), (IDS,)),
    "Decoder": (lambda dtype: attnkit.Decoder(9, 4, 2, 4, 4, 8, 16, 2, 0.0, dtype=dtype), (IDS, X)),
    "Transformer": (
        lambda dtype: attnkit.Transformer(9, 9, 4, 4, 2, 4, 4, 8, 16, 1, 0.0, dtype=dtype),
        ((IDS, IDS),),
    ),
}


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_policy_reaches_every_sublayer(name, policy):
    factory, inputs = LAYERS[name]
    layer = factory(policy)
    out = _first(layer(*inputs))
    assert {sub.dtype_policy.name for sub in layer._flatten_layers()} == {policy}
    expected = "float32" if name == "Transformer" else keras.DTypePolicy(policy).compute_dtype  # float32 logits
    assert keras.backend.standardize_dtype(out.dtype) == expected


@pytest.mark.parametrize("load_policy", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["MultiHeadAttention", "Encoder", "Transformer"])
def test_save_and_load_are_exact_whatever_the_global_policy(name, policy, load_policy, tmp_path):
    factory, inputs = LAYERS[name]
    keras.config.set_dtype_policy(policy)  # the model takes the global policy at construction
    if name == "Transformer":
        model = factory(None)
        model(*inputs)
    else:
        symbolic = [keras.Input(x.shape[1:], dtype=x.dtype) for x in inputs]
        model = keras.Model(symbolic, _first(factory(None)(*symbolic)))
    expected = to_numpy(model(*inputs) if name == "Transformer" else model(list(inputs)))
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    keras.config.set_dtype_policy(load_policy)
    loaded = keras.saving.load_model(path)
    # Keras gives the functional wrapper and its input layer the global policy; they compute nothing.
    layer = loaded if name == "Transformer" else loaded.layers[-1]
    assert {sub.dtype_policy.name for sub in layer._flatten_layers()} == {policy}
    got = to_numpy(loaded(*inputs) if name == "Transformer" else loaded(list(inputs)))
    np.testing.assert_array_equal(got.astype("float32"), expected.astype("float32"))
