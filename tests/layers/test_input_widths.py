"""Input widths: a first call of the wrong width leaves a layer unbuilt (the next, right call works), and
a built layer called with another width raises a ValueError naming the argument, on every backend."""

import numpy as np
import pytest

import attnkit

B, T, S, D = 2, 5, 7, 16


@pytest.fixture
def data(rng):
    return rng.standard_normal((B, T, D)).astype("float32"), rng.standard_normal((B, S, D)).astype("float32")


def test_a_refused_first_call_leaves_the_layer_unbuilt(data):
    x, memory = data
    ids = np.ones((B, T), "int32")
    cases = [
        (attnkit.EncoderLayer(4, 4, 4, D, 32, 0.0), (x[..., :8],), (x,), "`x` must have shape"),
        (attnkit.DecoderLayer(4, 4, 4, D, 32, 0.0), (x, memory[..., :8]), (x, memory), "`encoder_output` must have shape"),
        (attnkit.Decoder(20, T, 4, 4, 4, D, 32, 2, 0.0), (ids, memory[..., :8]), (ids, memory), "`encoder_output` must have shape"),
    ]
    for layer, wrong, right, message in cases:
        with pytest.raises(ValueError, match=message):
            layer(*wrong)
        assert not layer.built
        assert tuple(layer(*right).shape) == (B, T, D)


def test_a_built_layer_refuses_another_width(data):
    x, memory = data
    mha = attnkit.MultiHeadAttention(4, 4, 4, D)
    mha(x, memory)
    with pytest.raises(ValueError, match=r"`queries` must have 16 features, the width this layer was built for. "
                                         r"Received: queries.shape=\(2, 5, 12\)"):
        mha(x[..., :12], memory)
    with pytest.raises(ValueError, match=r"`keys` must have 16 features"):
        mha(x, memory[..., :8])
    with pytest.raises(ValueError, match=r"`values` must have 16 features"):
        mha(x, memory, memory[..., :8])
    feed_forward = attnkit.FeedForward(32, D)
    feed_forward(x)
    with pytest.raises(ValueError, match=r"`x` must have 16 features, the width this layer was built for"):
        feed_forward(x[..., :12])
    encoder_layer = attnkit.EncoderLayer(4, 4, 4, D, 32, 0.0)
    encoder_layer(x)
    with pytest.raises(ValueError, match=r"`x` must have shape \(batch, length, d_model=16\). Received: x.shape=\(2, 5, 8\)"):
        encoder_layer(x[..., :8])
