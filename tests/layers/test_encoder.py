"""Tests for Encoder: parity of the stack with torch.nn.TransformerEncoder, padding, token ids, serialization."""

import numpy as np
import pytest

import keras
from attnkit import Encoder
from attnkit.layers._keras_mask import keras_mask_of
from backend_utils import BACKEND, to_numpy
from encoder_checks import (
    assert_close, config_round_trip, fit_lowers_loss, keras_file_round_trip, mixed_bfloat16_close,
    torch_encoder_layer_like,
)

B, T, VOCAB, H, D, D_FF, N = 3, 8, 13, 4, 16, 32, 2


def make_encoder(rate=0.0, **kwargs):
    return Encoder(VOCAB, T, H, D // H, D // H, D, D_FF, N, rate, **kwargs)


def token_ids(rng, lengths=(8, 5, 2), t=T, pad_id=0):
    ids = rng.integers(1, VOCAB, (len(lengths), t))
    ids[ids == pad_id] = 1 if pad_id != 1 else 2
    for row, length in enumerate(lengths):
        ids[row, length:] = pad_id
    return ids


@pytest.mark.skipif(BACKEND != "torch", reason="torch.nn.TransformerEncoder needs the torch backend")
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_stack_equals_torch_transformer_encoder(rng, norm_first, activation):
    import torch

    encoder = make_encoder(norm_first=norm_first, activation=activation, epsilon=1e-5)
    ids = token_ids(rng)
    encoder(ids)  # builds every layer
    torch_layers = [torch_encoder_layer_like(layer, rng) for layer in encoder.encoder_layers]
    final_norm = None
    if norm_first:  # torch's TransformerEncoder(norm=...) ends pre-LN stacks with a layer norm, as ours
        final_norm = torch.nn.LayerNorm(D, eps=1e-5)
        with torch.no_grad():
            final_norm.weight.copy_(torch.from_numpy(rng.standard_normal(D).astype("float32")))
            final_norm.bias.copy_(torch.from_numpy(rng.standard_normal(D).astype("float32")))
        encoder.final_norm.set_weights([final_norm.weight.detach().numpy(), final_norm.bias.detach().numpy()])
    theirs = torch.nn.TransformerEncoder(torch_layers[0], N, norm=final_norm, enable_nested_tensor=False)
    for i, layer in enumerate(torch_layers):
        theirs.layers[i].load_state_dict(layer.state_dict())
    theirs.eval()
    x = rng.standard_normal((B, T, D)).astype("float32")
    keep = ids != 0
    with torch.no_grad():
        want = theirs(torch.from_numpy(x), src_key_padding_mask=torch.from_numpy(~keep)).numpy()
        want_unmasked = theirs(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(to_numpy(encoder.encode(x, keep))[keep], want[keep], atol=1e-5)
    np.testing.assert_allclose(to_numpy(encoder.encode(x)), want_unmasked, atol=1e-5)


def test_call_is_embeddings_then_the_stack(rng):
    encoder, ids = make_encoder(), token_ids(rng)
    out = encoder(ids)
    assert_close(out, encoder.encode(encoder.pos_encoding(ids), ids != 0), atol=1e-6)


def test_encode_reads_and_keeps_the_keras_mask_of_its_input(rng):
    encoder, ids = make_encoder(), token_ids(rng)
    x = encoder.pos_encoding(ids)  # (B, T, d_model), carrying the (B, T) padding mask
    np.testing.assert_array_equal(to_numpy(keras_mask_of(x)), ids != 0)
    out = encoder.encode(x)
    assert_close(out, encoder.encode(x, ids != 0), atol=0)
    np.testing.assert_array_equal(to_numpy(keras_mask_of(out)), ids != 0)


@pytest.mark.parametrize("pad_id", [0, 4])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_padding_never_changes_real_tokens(rng, pad_id, norm_first):
    encoder = make_encoder(pad_id=pad_id, norm_first=norm_first)
    ids = token_ids(rng, lengths=(5, 5, 5), t=5, pad_id=pad_id)
    short = to_numpy(encoder(ids))
    padded = to_numpy(encoder(np.concatenate([ids, np.full((B, 3), pad_id)], axis=1)))
    np.testing.assert_allclose(padded[:, :5], short, atol=1e-6)


def test_padding_comes_from_token_ids_and_an_explicit_mask_agrees(rng):
    encoder, ids = make_encoder(), token_ids(rng)
    from_ids = to_numpy(encoder(ids))
    assert_close(encoder(ids, ids != 0), from_ids, atol=0)
    unmasked = to_numpy(encoder(ids, np.ones_like(ids, bool)))  # attending to padding changes the result
    keep = ids != 0
    assert np.abs(unmasked[keep] - from_ids[keep]).max() > 1e-3


def test_output_carries_the_padding_mask_for_following_layers(rng):
    encoder, ids = make_encoder(), token_ids(rng)
    np.testing.assert_array_equal(to_numpy(keras_mask_of(encoder(ids))), ids != 0)
    inputs = keras.Input((None,), dtype="int32")
    model = keras.Model(inputs, keras.layers.GlobalAveragePooling1D()(make_encoder()(inputs)))
    short = token_ids(rng, lengths=(5, 5, 5), t=5)
    padded = np.concatenate([short, np.zeros((B, 3), int)], axis=1)
    np.testing.assert_allclose(model.predict(padded, verbose=0), model.predict(short, verbose=0), atol=1e-6)


def test_attention_weights_are_a_list_of_n_arrays(rng):
    encoder, ids = make_encoder(), token_ids(rng)
    out, weights = encoder(ids, return_attention_weights=True)
    assert len(weights) == N
    for w in map(to_numpy, weights):
        assert w.shape == (B, H, T, T)
        assert np.all(w[np.broadcast_to((ids == 0)[:, None, None, :], w.shape)] == 0)
    assert_close(out, encoder(ids), atol=1e-5)


def test_dropout_changes_outputs_only_in_training(rng):
    encoder, ids = make_encoder(rate=0.2), token_ids(rng)
    inference = to_numpy(encoder(ids))
    np.testing.assert_array_equal(to_numpy(encoder(ids, None, False)), inference)
    np.testing.assert_array_equal(to_numpy(encoder(ids)), inference)
    assert np.abs(to_numpy(encoder(ids, None, True)) - inference).max() > 1e-3  # the seeds' call


def test_integral_float_ids_equal_integer_ids(rng):
    encoder, ids = make_encoder(), token_ids(rng)
    np.testing.assert_array_equal(to_numpy(encoder(ids.astype("float32"))), to_numpy(encoder(ids)))


@pytest.mark.parametrize(
    "make_ids,message",
    [
        (lambda ids: ids + 0.25, r"`input_sentence` must hold integer token ids; floats are accepted only when they are whole numbers"),
        (lambda ids: np.random.default_rng(0).random(ids.shape), r"`input_sentence` must hold integer token ids; floats"),
        (lambda ids: ids - 3, r"`input_sentence` must hold token ids in \[0, vocab_size=13\). Received: input_sentence with values such as \[-3"),
        (lambda ids: ids * 0 + VOCAB, r"`input_sentence` must hold token ids in \[0, vocab_size=13\). Received: input_sentence with values such as \[13\]"),
        (lambda ids: np.ones((B, T + 1), int), r"`input_sentence` must be at most sequence_length=8 tokens long. Received: input_sentence.shape=\(3, 9\)"),
    ],
    ids=["fractional", "seed-random-floats", "negative", "vocab-size", "too-long"],
)
def test_bad_token_ids_raise(rng, make_ids, message):
    with pytest.raises(ValueError, match=message):
        make_encoder()(make_ids(token_ids(rng)))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(n=0), r"`n` must be a positive integer. Received: n=0"),
        (dict(d_ff=-1), r"`d_ff` must be a positive integer. Received: d_ff=-1"),
        (dict(rate=1.0), r"`rate` must be a float in \[0, 1\). Received: rate=1.0"),
        (dict(activation="elu"), r"`activation` must be one of \('relu', 'gelu', 'gelu_tanh', 'silu'\). Received: activation='elu'"),
        (dict(position="relative"), r"`position` must be one of \('sinusoidal', 'learned'\). Received: position='relative'"),
        (dict(pad_id=VOCAB), r"`pad_id` must be None or an integer in \[0, vocab_size=13\). Received: pad_id=13"),
    ],
)
def test_bad_constructor_arguments_raise(kwargs, message):
    args = dict(vocab_size=VOCAB, sequence_length=T, h=H, d_k=4, d_v=4, d_model=D, d_ff=D_FF, n=N, rate=0.1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Encoder(**args)


@pytest.mark.parametrize(
    "kwargs", [dict(), dict(norm_first=True, activation="gelu", position="learned", pad_id=None, epsilon=1e-5)]
)
def test_config_and_keras_file_round_trips(rng, tmp_path, kwargs):
    ids = token_ids(rng)
    config_round_trip(make_encoder(rate=0.1, **kwargs), ids)
    inputs = keras.Input((None,), dtype="int32")
    model = keras.Model(inputs, make_encoder(**kwargs)(inputs))
    keras_file_round_trip(model, ids, tmp_path / "encoder.keras")


def test_mixed_bfloat16_is_finite_and_close_to_float32(rng):
    mixed_bfloat16_close(make_encoder, (token_ids(rng),), atol=0.15)


def test_fit_step_lowers_the_loss(rng):
    inputs = keras.Input((T,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(make_encoder(rate=0.1)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(pooled))
    ids = token_ids(rng, lengths=(8, 5, 2, 7, 3, 6))
    fit_lowers_loss(model, ids, (ids == 3).sum(1, keepdims=True).astype("float32"))
