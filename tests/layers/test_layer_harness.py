"""Every attnkit layer through the shared harness: config, `.keras` file, symbolic shapes, masks, dtypes.

The layers' own test files check their numbers against references; this file runs the same Keras
contract on each of them, so a new layer gets it by adding one case.
"""

import numpy as np
import pytest

import attnkit
from attnkit.layers.decoder_only_layer import DecoderOnlyLayer
from attnkit.layers.position_embedding import LearnedPositionEmbedding
from attnkit.layers.residual import Residual
from attnkit.layers.rms_norm import RMSNorm
from attnkit.layers.swiglu import SwiGLUFeedForward
from layer_harness import run_layer_test

B, T, S, D, H, VOCAB = 2, 5, 4, 8, 2, 20
RNG = np.random.default_rng(19)
X = RNG.standard_normal((B, T, D)).astype("float32")
ENC = RNG.standard_normal((B, S, D)).astype("float32")
IDS = np.array([[3, 7, 1, 0, 0], [4, 5, 6, 2, 0]], "int32")
REAL = IDS != 0  # (B, T)
HEADS = RNG.standard_normal((B, H, T, 4)).astype("float32")
SIZES = dict(h=H, d_k=4, d_v=4, d_model=D, d_ff=16)
FFN = SwiGLUFeedForward(12, D)
# A decoder-only layer's rotary angles (B, 1, T, d_k) and causal keep-mask (B, 1, T, T), padding on the left.
ANGLES = np.arange(T, dtype="float32")[None, None, :, None] * np.linspace(0.1, 1.0, 4, dtype="float32")
COS, SIN = np.broadcast_to(np.cos(ANGLES), (B, 1, T, 4)).copy(), np.broadcast_to(np.sin(ANGLES), (B, 1, T, 4)).copy()
LEFT_REAL = np.array([[True] * T, [False, True, True, True, True]])  # (B, T)
CAUSAL_KEEP = np.tril(np.ones((T, T), bool))[None, None] & LEFT_REAL[:, None, None, :]  # (B, 1, T, T)
FFN.build((None, None, D))

# name -> (factory of keyword arguments, inputs, call keywords, harness options)
CASES = {
    "AddNormalization": (lambda **kw: attnkit.AddNormalization(**kw), (X, 0.5 * X), {},
                         dict(input_mask=REAL, bf16_atol=0.05)),
    "AdditiveAttention": (lambda **kw: attnkit.AdditiveAttention(6, **kw), (X, ENC, ENC), {}, dict(bf16_atol=0.1)),
    "DotProductAttention": (lambda **kw: attnkit.DotProductAttention(**kw), (HEADS, HEADS, HEADS), {},
                            dict(bf16_atol=0.1)),
    "MultiHeadAttention": (lambda **kw: attnkit.MultiHeadAttention(H, 4, 4, D, **kw), (X, ENC, ENC), {},
                           dict(input_mask=REAL, bf16_atol=0.1)),
    "FeedForward": (lambda **kw: attnkit.FeedForward(16, D, **kw), (X,), {}, dict(input_mask=REAL, bf16_atol=0.1)),
    "Linear": (lambda **kw: attnkit.Linear(6, **kw), (X,), {}, dict(bf16_atol=0.1)),
    "EncoderLayer": (lambda **kw: attnkit.EncoderLayer(**SIZES, rate=0.1, **kw), (X,), {},
                     dict(input_mask=REAL, bf16_atol=0.1)),
    "EncoderLayer-pre-LN-weights": (lambda **kw: attnkit.EncoderLayer(**SIZES, rate=0.1, norm_first=True, **kw), (X,),
                                    {"return_attention_weights": True}, dict(bf16_atol=0.1)),
    "DecoderLayer": (lambda **kw: attnkit.DecoderLayer(**SIZES, rate=0.1, **kw), (X, ENC), {},
                     dict(input_mask=REAL, bf16_atol=0.1)),
    "DecoderLayer-pre-LN-weights": (lambda **kw: attnkit.DecoderLayer(**SIZES, rate=0.1, norm_first=True, **kw),
                                    (X, ENC), {"return_attention_weights": True}, dict(bf16_atol=0.1)),
    "Encoder": (lambda **kw: attnkit.Encoder(VOCAB, T, **SIZES, n=2, rate=0.1, **kw), (IDS,), {},
                dict(expected_output_mask=REAL, bf16_atol=0.15)),
    "Encoder-learned": (lambda **kw: attnkit.Encoder(VOCAB, T, **SIZES, n=1, rate=0.0, position="learned", **kw),
                        (IDS,), {}, dict(expected_output_mask=REAL, bf16_atol=0.15)),
    "Decoder": (lambda **kw: attnkit.Decoder(VOCAB, T, **SIZES, n=2, rate=0.1, **kw), (IDS, ENC), {},
                dict(expected_output_mask=REAL, bf16_atol=0.15)),
    "PositionEmbeddingFixedWeights": (lambda **kw: attnkit.PositionEmbeddingFixedWeights(T, VOCAB, D, **kw), (IDS,),
                                      {}, dict(expected_output_mask=REAL, bf16_atol=0.05)),
    "LearnedPositionEmbedding": (lambda **kw: LearnedPositionEmbedding(T, VOCAB, D, **kw), (IDS,), {},
                                 dict(expected_output_mask=REAL, bf16_atol=0.05)),
    "SinusoidalPositionEncoding": (lambda **kw: attnkit.SinusoidalPositionEncoding(T, D, **kw), (X,), {},
                                   dict(input_mask=REAL, bf16_atol=0.05)),
    "DecoderOnlyLayer": (lambda **kw: DecoderOnlyLayer(H, 4, D, 16, num_kv_heads=1, **kw), (X, COS, SIN, CAUSAL_KEEP),
                         {}, dict(bf16_atol=0.1)),
    "DecoderOnlyLayer-window-weights": (
        lambda **kw: DecoderOnlyLayer(H, 4, D, 16, sliding_window=2, attention_bias=True, **kw),
        (X, COS, SIN, CAUSAL_KEEP), {"return_attention_weights": True}, dict(bf16_atol=0.1)),
    "RMSNorm": (lambda **kw: RMSNorm(**kw), (X,), {}, dict(bf16_atol=0.05)),
    "SwiGLUFeedForward": (lambda **kw: SwiGLUFeedForward(12, D, **kw), (X,), {}, dict(bf16_atol=0.1)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_contract(name, tmp_path):
    make_layer, inputs, call_kwargs, options = CASES[name]
    outputs = run_layer_test(make_layer, inputs, call_kwargs, tmp_path=tmp_path, **options)
    assert all(np.all(np.isfinite(output)) for output in outputs)


def test_residual_contract():
    # The sub-layer is a Python callable: no `.keras` model can hold it, so that check is left out.
    run_layer_test(
        lambda **kw: Residual(RMSNorm(**kw), norm_first=True, **kw), (X,), {"sublayer": FFN}, input_mask=REAL,
    )
