"""return_attention_weights=True in a functional model: the encoder and decoder layers and stacks give
the same outputs and weights, of the same structure, as their eager calls."""

import keras
import numpy as np

import attnkit
from backend_utils import to_numpy

B, T, S, V, H, D, D_FF, N = 2, 5, 6, 10, 4, 16, 32, 2


def test_functional_model_returns_the_weights_of_every_layer(rng):
    encoder_layer = attnkit.EncoderLayer(H, D // H, D // H, D, D_FF, 0.0)
    encoder = attnkit.Encoder(V, S, H, D // H, D // H, D, D_FF, N, 0.0)
    decoder_layer = attnkit.DecoderLayer(H, D // H, D // H, D, D_FF, 0.0)
    decoder = attnkit.Decoder(V, T, H, D // H, D // H, D, D_FF, N, 0.0)
    source, target = keras.Input((S,), dtype="int32"), keras.Input((T,), dtype="int32")
    embedding = keras.layers.Embedding(V, D)
    memory, encoder_weights = encoder(source, return_attention_weights=True)
    x, layer_weights = encoder_layer(embedding(target), return_attention_weights=True)
    y, self_weights, cross_weights = decoder_layer(x, memory, return_attention_weights=True)
    z, stack_self, stack_cross = decoder(target, memory, return_attention_weights=True)
    assert tuple(layer_weights.shape) == (None, H, T, T) and tuple(cross_weights.shape) == (None, H, T, S)
    assert len(encoder_weights) == len(stack_self) == len(stack_cross) == N
    model = keras.Model(
        [source, target], [memory, encoder_weights, layer_weights, y, self_weights, cross_weights, z, stack_cross]
    )
    src, tgt = rng.integers(1, V, (B, S)), rng.integers(1, V, (B, T))
    got = model([src, tgt])
    want_memory, want_encoder_weights = encoder(src, return_attention_weights=True)
    want_x, want_layer_weights = encoder_layer(embedding(tgt), return_attention_weights=True)
    want_y, want_self, want_cross = decoder_layer(want_x, want_memory, return_attention_weights=True)
    want_z, _, want_stack_cross = decoder(tgt, want_memory, return_attention_weights=True)
    want = [want_memory, want_encoder_weights, want_layer_weights, want_y, want_self, want_cross, want_z, want_stack_cross]
    for g, w in zip(got, want):
        for a, b in zip(*(x if isinstance(x, list) else [x] for x in (g, w))):
            np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=0, atol=1e-5)
