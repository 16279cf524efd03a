"""The public seams of issue 19: the embedding's table and positions, the learned-position class, the
attention's `join_keras_mask`, the shared size checks, positional `training`, and MHA's path choice."""

import numpy as np
import pytest

import attnkit
import keras
from attnkit.layers import multi_head_attention as mha_module
from attnkit.layers._keras_mask import with_keras_mask
from attnkit.layers.position_embedding import LearnedPositionEmbedding, PositionEmbeddingFixedWeights
from attnkit import kernels as _fused
from backend_utils import to_numpy

B, T, D, VOCAB = 2, 6, 8, 30
IDS = np.array([[3, 7, 1, 9, 0, 0], [4, 5, 6, 2, 8, 0]], "int32")


@pytest.mark.parametrize("position", ["sinusoidal", "learned"])
def test_embed_at_continues_the_positions_of_call(position):
    layer = PositionEmbeddingFixedWeights(T, VOCAB, D, position=position)
    whole = to_numpy(layer(IDS))  # (B, T, D)
    for start in range(T):
        part = to_numpy(layer.embed_at(keras.ops.convert_to_tensor(IDS[:, start:start + 2]), start))
        np.testing.assert_allclose(part, whole[:, start:start + 2], atol=1e-6)
    assert layer.token_embeddings is layer.token_embedding.embeddings


def test_embed_at_with_position_ids_and_its_refusal():
    layer = LearnedPositionEmbedding(T, VOCAB, D, scale_embeddings=False)
    layer.build(IDS.shape)
    position_ids = np.array([[5, 4, 3, 2, 1, 0]] * B, "int32")
    got = to_numpy(layer.embed_at(IDS, position_ids=position_ids))
    tokens, positions = to_numpy(layer.token_embedding.embeddings), to_numpy(layer.position_embedding.embeddings)
    np.testing.assert_allclose(got, tokens[IDS] + positions[position_ids], atol=1e-6)
    with pytest.raises(ValueError, match="position_ids"):
        PositionEmbeddingFixedWeights(T, VOCAB, D).embed_at(IDS, position_ids=position_ids)


def test_learned_position_embedding_is_the_learned_variant_under_its_own_name():
    ours = LearnedPositionEmbedding(T, VOCAB, D, pad_id=0)
    seed = PositionEmbeddingFixedWeights(T, VOCAB, D, position="learned", pad_id=0)
    ours.build(IDS.shape), seed.build(IDS.shape)
    seed.set_weights(ours.get_weights())
    np.testing.assert_array_equal(to_numpy(ours(IDS)), to_numpy(seed(IDS)))
    np.testing.assert_array_equal(to_numpy(ours.compute_mask(IDS)), IDS != 0)
    assert "position" not in ours.get_config()
    with pytest.raises(TypeError):
        LearnedPositionEmbedding(T, VOCAB, D, position="sinusoidal")


def test_stacks_with_learned_positions_use_the_honest_class():
    encoder = attnkit.Encoder(VOCAB, T, 2, 4, 4, D, 16, 1, 0.0, position="learned")
    assert type(encoder.pos_encoding) is LearnedPositionEmbedding
    assert type(attnkit.Encoder(VOCAB, T, 2, 4, 4, D, 16, 1, 0.0).pos_encoding) is PositionEmbeddingFixedWeights
    decoder = attnkit.Decoder(VOCAB, T, 2, 4, 4, D, 16, 1, 0.0)
    with pytest.raises(ValueError, match="once it is built"):
        decoder.token_embeddings
    decoder.build(IDS.shape, (B, 3, D))
    assert decoder.token_embeddings is decoder.pos_encoding.token_embedding.embeddings


def test_join_keras_mask_is_a_public_config_field(rng):
    x = rng.standard_normal((B, T, D)).astype("float32")
    padding = keras.ops.convert_to_tensor(IDS != 0)
    explicit = np.ones((B, 1, T), bool)
    outputs = {}
    for join in (True, False):
        layer = attnkit.MultiHeadAttention(2, 4, 4, D, join_keras_mask=join, seed=1)
        layer.build(x.shape)
        if outputs:
            layer.set_weights(weights)
        weights = layer.get_weights()
        assert layer.get_config()["join_keras_mask"] is join
        outputs[join] = to_numpy(layer(with_keras_mask(keras.ops.convert_to_tensor(x), padding), mask=explicit))
    # Joined, the padded keys are hidden; not joined, the explicit all-True mask alone decides.
    hidden = layer(x, mask=explicit & (IDS != 0)[:, None, :])
    np.testing.assert_allclose(outputs[True], to_numpy(hidden), atol=1e-6)
    assert not np.allclose(outputs[True], outputs[False], atol=1e-4)
    with pytest.raises(ValueError, match="join_keras_mask"):
        attnkit.MultiHeadAttention(2, 4, 4, D, join_keras_mask="yes")


@pytest.mark.parametrize(
    "name, value, message",
    [("h", 0, "`h` must be a positive integer"), ("d_ff", 2.5, "`d_ff` must be a positive integer"),
     ("rate", 1.0, "`rate` must be a float in"), ("epsilon", -1.0, "`epsilon` must be a finite positive"),
     ("norm_first", "yes", "`norm_first` must be a bool"), ("activation", "tanh", "`activation` must be one of")],
)
def test_one_size_check_for_every_stack(name, value, message):
    sizes = dict(h=2, d_k=4, d_v=4, d_model=D, d_ff=16, rate=0.1)
    stacks = [
        lambda **kw: attnkit.EncoderLayer(**kw), lambda **kw: attnkit.DecoderLayer(**kw),
        lambda **kw: attnkit.Encoder(VOCAB, T, n=1, **kw), lambda **kw: attnkit.Decoder(VOCAB, T, n=1, **kw),
    ]
    for make in stacks:
        with pytest.raises(ValueError, match=message):
            make(**{**sizes, name: value})
    if name != "norm_first":  # BERT is post-LN only
        bert_sizes = {k: v for k, v in {**sizes, name: value}.items()}
        with pytest.raises(ValueError, match=message):
            attnkit.BertEncoder(VOCAB, T, n=1, **bert_sizes)


def test_positional_training_reaches_every_stack(rng):
    x = rng.standard_normal((B, T, D)).astype("float32")
    layer = attnkit.EncoderLayer(2, 4, 4, D, 16, 0.5)
    off = to_numpy(layer(x, None, False))
    np.testing.assert_array_equal(off, to_numpy(layer(x, None, training=False)))
    assert not np.allclose(to_numpy(layer(x, None, True)), off)
    decoder_layer = attnkit.DecoderLayer(2, 4, 4, D, 16, 0.5)
    off = to_numpy(decoder_layer(x, x, None, None, False))
    assert not np.allclose(to_numpy(decoder_layer(x, x, None, None, True)), off)


def test_norms_are_the_blocks_norms():
    layer = attnkit.DecoderLayer(2, 4, 4, D, 16, 0.0, norm_first=True, epsilon=1e-5)
    norms = layer.norms
    assert len(norms) == 3 and all(isinstance(n, keras.layers.LayerNormalization) for n in norms)
    assert [n.epsilon for n in norms] == [1e-5] * 3
    assert norms[1] is layer.cross_attention_block.norm


def test_the_path_table(monkeypatch):
    layer = attnkit.MultiHeadAttention(2, 4, 4, D)
    layer.build((None, None, D))
    projections = (layer.W_q, layer.W_k, layer.W_v)
    for fuses, per_head in ((True, False), (False, True), (False, False)):
        monkeypatch.setattr(_fused, "fuses_projections", lambda fuses=fuses: fuses)
        monkeypatch.setattr(_fused, "projects_into_heads", lambda per_head=per_head: per_head)
        shared = mha_module.projection_path(projections, shared_input=True)
        alone = mha_module.projection_path((layer.W_q,), shared_input=True)
        assert shared == (mha_module.SIDE_BY_SIDE if fuses else mha_module.PER_HEAD if per_head else mha_module.DENSE)
        assert alone == (mha_module.PER_HEAD if per_head else mha_module.DENSE)
        assert mha_module.projection_path(projections) != mha_module.SIDE_BY_SIDE  # not one input
    assert mha_module.attention_path(True, True) == mha_module.GROUPED
    assert mha_module.attention_path(False, True) == mha_module.EXPLICIT
    assert mha_module.attention_path(False, False) == mha_module.FUSED
