"""`BertEncoder`'s family options: no token types, RoBERTa's positions, ELECTRA's projected embeddings;
checked against a float64 NumPy forward of the embedding stage and through a config round trip."""

import keras
import numpy as np
import pytest

from attnkit.models import BertEncoder

SIZES = dict(vocab_size=12, sequence_length=10, h=2, d_k=3, d_v=3, d_model=6, d_ff=8, n=1, rate=0.0)


def _embedding_stage(model, ids):
    """float64 NumPy: LayerNorm(token + position (+ type 0)) then the projection, as transformers computes it."""
    layer = model.token_position_embedding
    tokens = keras.ops.convert_to_numpy(layer.token_embedding.embeddings).astype(np.float64)
    positions = keras.ops.convert_to_numpy(layer.position_embedding.embeddings).astype(np.float64)
    if model.positions == "after_padding":
        real = (ids != model.pad_id).astype(np.int64)
        position_ids = np.cumsum(real, axis=1) * real + model.pad_id
    else:
        position_ids = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    x = tokens[ids] + positions[position_ids]
    if model.token_type_embedding is not None:
        x = x + keras.ops.convert_to_numpy(model.token_type_embedding.embeddings).astype(np.float64)[0]
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    gamma = keras.ops.convert_to_numpy(model.embedding_norm.gamma)
    beta = keras.ops.convert_to_numpy(model.embedding_norm.beta)
    x = (x - mean) / np.sqrt(var + model.epsilon) * gamma + beta
    if model.embedding_projection is not None:
        x = x @ keras.ops.convert_to_numpy(model.embedding_projection.kernel) + keras.ops.convert_to_numpy(
            model.embedding_projection.bias)
    return x


@pytest.mark.parametrize("options", [
    dict(type_vocab_size=0),
    dict(positions="after_padding", pad_id=1, type_vocab_size=1),
    dict(embedding_size=4),
])
def test_embedding_stage_and_config_round_trip(options):
    model = BertEncoder(**SIZES, **options)
    ids = np.array([[2, 5, 7, 3, model.pad_id, model.pad_id], [2, 9, 4, 8, 11, 3]], np.int32)
    model(ids)
    captured, original_call = {}, model.encoder_layers[0].call

    def spy(x, *args, **kwargs):  # the first layer's input: the embedding stage's output
        captured["x"] = x
        return original_call(x, *args, **kwargs)

    model.encoder_layers[0].call = spy
    model(ids)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(captured["x"]), _embedding_stage(model, ids), atol=1e-5)
    clone = BertEncoder.from_config(model.get_config())
    clone(ids)
    clone.set_weights(model.get_weights())
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(clone(ids)), keras.ops.convert_to_numpy(model(ids)))


def test_after_padding_positions_limit_the_length():
    model = BertEncoder(**SIZES, positions="after_padding", pad_id=1)
    assert model.max_length == SIZES["sequence_length"] - 2
    with pytest.raises(ValueError, match="token_ids"):
        model(np.full((1, 9), 2, np.int32))


@pytest.mark.parametrize("options, message", [
    (dict(positions="relative"), r"`positions` must be one of \('absolute', 'after_padding'\). Received: positions='relative'"),
    (dict(positions="after_padding", pad_id=None), r"needs a pad_id below sequence_length - 1"),
    (dict(type_vocab_size=False), r"type_vocab_size"),
])
def test_invalid_options_are_refused(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        BertEncoder(**SIZES, **options)


def test_token_types_without_a_table_are_refused():
    model = BertEncoder(**SIZES, type_vocab_size=0)
    ids = np.array([[2, 3]], np.int32)
    with pytest.raises(ValueError, match=r"`token_type_ids` was given, but this encoder has no token types"):
        model(ids, token_type_ids=np.zeros_like(ids))


@pytest.mark.parametrize("activation, reference", [
    ("gelu_tanh", lambda y: 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y**3)))),  # transformers' gelu_new
    ("silu", lambda y: y / (1 + np.exp(-y))),
])
def test_feed_forward_activations_of_the_checkpoint_families(tmp_path, activation, reference):
    from attnkit.layers import FeedForward

    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32) * 3
    model = keras.Sequential([keras.Input((3, 4)), FeedForward(5, 4, activation=activation)])
    layer = model.layers[0]
    w1, b1, w2, b2 = (keras.ops.convert_to_numpy(v).astype(np.float64) for v in (
        layer.fully_connected1.kernel, layer.fully_connected1.bias, layer.fully_connected2.kernel, layer.fully_connected2.bias))
    expected = reference(x.astype(np.float64) @ w1 + b1) @ w2 + b2
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model(x)), expected, atol=1e-5)
    model.save(tmp_path / "m.keras")
    reloaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(reloaded(x)), keras.ops.convert_to_numpy(model(x)))
