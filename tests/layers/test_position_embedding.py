"""Tests for the sinusoidal table, SinusoidalPositionEncoding and PositionEmbeddingFixedWeights."""

import math

import numpy as np
import pytest

import keras
from attnkit import PositionEmbeddingFixedWeights, SinusoidalPositionEncoding, sinusoidal_position_encoding
from attnkit.layers._keras_mask import keras_mask_of
from backend_utils import to_numpy
from encoder_checks import assert_close, config_round_trip, keras_file_round_trip, mixed_bfloat16_close

T, VOCAB, D = 7, 11, 6


def paper_table(length, d_model):
    """Section 3.5 written out entry by entry, in float64."""
    table = np.zeros((length, d_model))
    for pos in range(length):
        for col in range(d_model):
            i = col // 2
            angle = pos / 10000 ** (2 * i / d_model)
            table[pos, col] = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    return table


@pytest.mark.parametrize("length,d_model", [(50, 512), (9, 7), (1, 1)])
def test_table_equals_the_paper_formula_in_float64(length, d_model):
    want = paper_table(length, d_model)
    np.testing.assert_allclose(sinusoidal_position_encoding(length, d_model, dtype="float64"), want, atol=1e-12)
    table = sinusoidal_position_encoding(length, d_model)
    assert table.dtype == np.float32
    np.testing.assert_array_equal(table, want.astype("float32"))  # correctly rounded from float64


def test_sinusoidal_layer_adds_the_table_and_returns_it():
    layer = SinusoidalPositionEncoding(sequence_length=T, d_model=D)
    x = np.random.default_rng(0).standard_normal((2, 5, D)).astype("float32")
    assert_close(layer(x), x + paper_table(5, D)[None], atol=1e-6)
    assert_close(layer.table(5), paper_table(5, D), atol=1e-6)
    assert tuple(layer.table().shape) == (T, D)


def test_sinusoidal_layer_rejects_wrong_width_and_too_long_inputs():
    layer = SinusoidalPositionEncoding(sequence_length=T, d_model=D)
    with pytest.raises(ValueError, match=r"`inputs` must have shape \(batch, length, d_model=6\)\. Received: inputs.shape=\(2, 3, 5\)"):
        layer(np.zeros((2, 3, 5), "float32"))
    with pytest.raises(ValueError, match=r"at most sequence_length=7 positions long. Received: inputs.shape=\(2, 8, 6\)"):
        layer(np.zeros((2, 8, D), "float32"))


def make_embedding(**kwargs):
    layer = PositionEmbeddingFixedWeights(T, VOCAB, D, **kwargs)
    layer.build((None, T))
    rng = np.random.default_rng(3)
    layer.token_embedding.set_weights([rng.standard_normal((VOCAB, D)).astype("float32")])
    if layer.position == "learned":
        layer.position_embedding.set_weights([rng.standard_normal((T, D)).astype("float32")])
    return layer


IDS = np.array([[3, 7, 1, 10, 0], [5, 0, 0, 0, 0]])


def test_tokens_are_scaled_by_sqrt_d_model_and_sinusoids_added():
    layer = make_embedding()
    table = layer.token_embedding.get_weights()[0]
    want = table[IDS] * math.sqrt(D) + paper_table(5, D)[None]
    assert_close(layer(IDS), want, atol=1e-5)


def test_scaling_can_be_turned_off():
    layer = make_embedding(scale_embeddings=False)
    want = layer.token_embedding.get_weights()[0][IDS] + paper_table(5, D)[None]
    assert_close(layer(IDS), want, atol=1e-6)


def test_learned_positions_add_one_vector_per_position():
    layer = make_embedding(position="learned", scale_embeddings=False)
    tokens, positions = layer.token_embedding.get_weights()[0], layer.position_embedding.get_weights()[0]
    assert_close(layer(IDS), tokens[IDS] + positions[None, :5], atol=1e-6)
    assert len(layer.trainable_weights) == 2


def test_sinusoidal_positions_have_no_weights():
    layer = make_embedding()
    assert [w.name for w in layer.weights] == ["embeddings"]


@pytest.mark.parametrize("pad_id", [0, 3])
def test_mask_is_true_at_real_tokens(pad_id):
    layer = make_embedding(pad_id=pad_id)
    want = IDS != pad_id
    np.testing.assert_array_equal(to_numpy(layer.compute_mask(IDS)), want)
    np.testing.assert_array_equal(to_numpy(keras_mask_of(layer(IDS))), want)


def test_no_mask_when_pad_id_is_none():
    layer = make_embedding(pad_id=None)
    assert layer.compute_mask(IDS) is None
    assert keras_mask_of(layer(IDS)) is None


def test_integral_floats_are_accepted_as_ids():
    layer = make_embedding()
    np.testing.assert_array_equal(to_numpy(layer(IDS.astype("float32"))), to_numpy(layer(IDS)))


@pytest.mark.parametrize(
    "ids,message",
    [
        (IDS + 0.5, r"`inputs` must hold integer token ids; floats are accepted only when they are whole numbers. Received: inputs with values such as \[0.5, 1.5, 3.5\]"),
        (IDS - 2, r"`inputs` must hold token ids in \[0, vocab_size=11\). Received: inputs with values such as \[-2, -1\]"),
        (IDS + 5, r"`inputs` must hold token ids in \[0, vocab_size=11\). Received: inputs with values such as \[12, 15\]"),
        (np.ones((2, T + 1), "int32"), r"`inputs` must be at most sequence_length=7 tokens long. Received: inputs.shape=\(2, 8\)"),
        (np.ones((5,), "int32"), r"`inputs` must have rank 2, \(batch, length\), of token ids. Received: inputs.shape=\(5\)"),
    ],
    ids=["fractional", "negative", "too-large", "too-long", "rank-1"],
)
def test_bad_token_ids_raise(ids, message):
    with pytest.raises(ValueError, match=message):
        make_embedding()(ids)


def test_boolean_ids_raise_type_error():
    with pytest.raises(TypeError, match=r"`inputs` must hold integer token ids. Received: inputs with dtype=bool"):
        make_embedding()(IDS > 2)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(position="rotary"), r"`position` must be one of \('sinusoidal', 'learned'\). Received: position='rotary'"),
        (dict(pad_id=11), r"`pad_id` must be None or an integer in \[0, vocab_size=11\). Received: pad_id=11"),
        (dict(pad_id=-1), r"Received: pad_id=-1"),
        (dict(d_model=0), r"`d_model` must be a positive integer. Received: d_model=0"),
        (dict(sequence_length=2.5), r"`sequence_length` must be a positive integer. Received: sequence_length=2.5"),
    ],
)
def test_bad_constructor_arguments_raise(kwargs, message):
    args = dict(sequence_length=T, vocab_size=VOCAB, d_model=D)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        PositionEmbeddingFixedWeights(**args)


@pytest.mark.parametrize("position", ["sinusoidal", "learned"])
def test_config_round_trip(position):
    layer = make_embedding(position=position, pad_id=2, scale_embeddings=False)
    config_round_trip(layer, IDS)
    config_round_trip(SinusoidalPositionEncoding(T, D), np.ones((2, 3, D), "float32"))


def test_keras_file_round_trip_in_functional_model(tmp_path):
    inputs = keras.Input((None,), dtype="int32")
    outputs = PositionEmbeddingFixedWeights(T, VOCAB, D, position="learned")(inputs)
    outputs = keras.layers.GlobalAveragePooling1D()(outputs)  # honours the padding mask
    model = keras.Model(inputs, outputs)
    keras_file_round_trip(model, IDS, tmp_path / "embedding.keras")


def test_mixed_bfloat16_is_finite_and_close_to_float32():
    mixed_bfloat16_close(lambda: PositionEmbeddingFixedWeights(T, VOCAB, D), (IDS,), atol=0.05)
