"""`inference_function`: the model's own numbers without dropout, weights assigned later are used, and
nothing is recorded for gradients on torch."""

import keras
import numpy as np
import pytest

import attnkit
from attnkit.models._inference import inference_function
from backend_utils import BACKEND, to_numpy

B, T, D = 3, 6, 8


@pytest.fixture
def encoder(rng):
    model = attnkit.Encoder(30, T, 2, 4, 4, D, 16, 2, 0.5)  # dropout 0.5: any training-mode run shows
    model.build((None, T))
    return model


def token_ids(rng):
    ids = rng.integers(1, 30, size=(B, T)).astype("int32")
    ids[0, 4:] = 0  # padding
    return keras.ops.convert_to_tensor(ids)


def test_equals_the_model_in_inference_mode(rng, encoder):
    ids = token_ids(rng)
    run = inference_function(encoder)
    want = to_numpy(encoder(ids, training=False))
    np.testing.assert_allclose(to_numpy(run(ids)), want, atol=1e-6)
    np.testing.assert_allclose(to_numpy(run(ids)), want, atol=1e-6)  # deterministic: no dropout


def test_fixed_keyword_arguments_are_passed(rng, encoder):
    ids = token_ids(rng)
    hidden, weights = inference_function(encoder, return_attention_weights=True)(ids)
    want_hidden, want_weights = encoder(ids, training=False, return_attention_weights=True)
    np.testing.assert_allclose(to_numpy(hidden), to_numpy(want_hidden), atol=1e-6)
    assert len(weights) == 2
    for got, want in zip(weights, want_weights):
        np.testing.assert_allclose(to_numpy(got), to_numpy(want), atol=1e-6)


def test_uses_weights_assigned_after_it_was_made(rng, encoder):
    ids = token_ids(rng)
    run = inference_function(encoder)
    before = to_numpy(run(ids))
    encoder.set_weights([rng.standard_normal(w.shape).astype("float32") for w in encoder.get_weights()])
    after = to_numpy(run(ids))
    assert np.abs(after - before).max() > 1e-2
    np.testing.assert_allclose(after, to_numpy(encoder(ids, training=False)), atol=1e-5)


@pytest.mark.skipif(BACKEND != "torch", reason="autograd graphs are a torch notion")
def test_records_no_autograd_graph_on_torch(rng, encoder):
    out = inference_function(encoder)(token_ids(rng))
    assert not out.requires_grad and out.grad_fn is None
