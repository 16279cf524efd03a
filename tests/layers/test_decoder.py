"""Tests for Decoder: no look-ahead, cross-attention, target padding, cached decode steps, bad inputs."""

import numpy as np
import pytest

from attnkit.layers.decoder import Decoder
from backend_utils import to_numpy

B, T, S, VOCAB, H, D, D_FF, N = 3, 7, 6, 13, 2, 8, 16, 2
SOURCE_LENGTHS = (6, 4, 2)


def make_decoder(rate=0.0, **kwargs):
    return Decoder(VOCAB, T, H, D // H, D // H, D, D_FF, N, rate, **kwargs)


def source_keep(lengths=SOURCE_LENGTHS):
    return np.arange(S)[None, :] < np.array(lengths)[:, None]  # (B, S), True at real tokens


def target_ids(rng, t=T):
    return rng.integers(1, VOCAB, (B, t))  # no padding id


def encoder_output(rng):
    return rng.standard_normal((B, S, D)).astype("float32")


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_no_position_sees_the_future_but_every_position_sees_the_source(rng, norm_first):
    decoder = make_decoder(norm_first=norm_first)
    ids, memory, keep = target_ids(rng), encoder_output(rng), source_keep()
    base = to_numpy(decoder(ids, memory, None, keep))
    for t in (0, 3, 5):
        changed = ids.copy()
        changed[:, t + 1:] = 1 + (changed[:, t + 1:] % (VOCAB - 1))  # another real token everywhere after t
        out = to_numpy(decoder(changed, memory, None, keep))
        np.testing.assert_allclose(out[:, : t + 1], base[:, : t + 1], atol=1e-6)
        assert np.abs(out[:, t + 1:] - base[:, t + 1:]).max(axis=-1).min() > 1e-4
    other = memory.copy()
    other[:, 1] += 1.0  # a real source token of every sequence
    out = to_numpy(decoder(ids, other, None, keep))
    assert np.abs(out - base).max(axis=-1).min() > 1e-4  # every target position of every sequence


def test_target_padding_is_hidden_from_later_positions(rng):
    decoder = make_decoder()
    ids, memory = target_ids(rng), encoder_output(rng)
    ids[:, 2] = 0  # the padding id as a target token
    _, self_weights, cross_weights = decoder(ids, memory, return_attention_weights=True)
    assert len(self_weights) == N and len(cross_weights) == N
    for weights in self_weights:
        weights = to_numpy(weights)
        assert weights.shape == (B, H, T, T)
        assert np.all(weights[..., 2] == 0) and np.all(weights[..., np.triu(np.ones((T, T), bool), k=1)] == 0)
    assert tuple(cross_weights[0].shape) == (B, H, T, S)
    every_token = np.ones((B, T), bool)  # an explicit keep-mask overrides the one from pad_id
    _, self_weights, _ = decoder(ids, memory, every_token, return_attention_weights=True)
    assert np.all(to_numpy(self_weights[0])[:, :, 3:, 2] > 0)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_decode_steps_concatenated_equal_the_full_call(rng, norm_first):
    decoder = make_decoder(norm_first=norm_first)
    ids, memory, keep = target_ids(rng), encoder_output(rng), source_keep()
    full, _, full_cross = decoder(ids, memory, None, keep, return_attention_weights=True)
    cross_keys_values = decoder.project_encoder_output(memory)
    cache, outputs, cross = decoder.new_cache(ids.shape[0]), [], []
    for t in range(T):
        out, weights = decoder.decode_step(ids[:, t:t + 1], cache, cross_keys_values, keep, return_attention_weights=True)
        outputs.append(to_numpy(out))
        cross.append([to_numpy(w) for w in weights])
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), to_numpy(full), atol=1e-5)
    for layer, want in enumerate(full_cross):
        got = np.concatenate([step[layer] for step in cross], axis=2)
        np.testing.assert_allclose(got, to_numpy(want), atol=1e-5)
    with pytest.raises(ValueError, match=r"Decoding past the decoder's sequence_length=7. Received: start=7"):
        decoder.decode_step(ids[:, :1], cache, cross_keys_values, keep)


def test_dropout_changes_outputs_only_in_training(rng):
    decoder = make_decoder(rate=0.3)
    ids, memory = target_ids(rng), encoder_output(rng)
    inference = to_numpy(decoder(ids, memory))
    np.testing.assert_array_equal(to_numpy(decoder(ids, memory, training=False)), inference)
    training = to_numpy(decoder(ids, memory, None, None, True))  # the seeds' positional call
    assert np.abs(training - inference).max() > 1e-3


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(h=0), r"`h` must be a positive integer. Received: h=0"),
        (dict(n=0), r"`n` must be a positive integer. Received: n=0"),
        (dict(vocab_size=-1), r"`vocab_size` must be a positive integer. Received: vocab_size=-1"),
        (dict(rate=1.0), r"`rate` must be a float in \[0, 1\). Received: rate=1.0"),
        (dict(activation="tanh"), r"`activation` must be one of \('relu', 'gelu', 'gelu_tanh', 'silu'\). Received: activation='tanh'"),
    ],
)
def test_bad_constructor_arguments_raise(kwargs, message):
    args = dict(vocab_size=VOCAB, sequence_length=T, h=H, d_k=4, d_v=4, d_model=D, d_ff=D_FF, n=N, rate=0.1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Decoder(**args)


def test_bad_inputs_raise(rng):
    decoder = make_decoder()
    ids, memory = target_ids(rng), encoder_output(rng)
    decoder(ids, memory)
    with pytest.raises(
        ValueError,
        match=r"`encoder_output` must have shape \(batch, length, d_model=8\). Received: encoder_output.shape=\(3, 6, 4\)",
    ):
        decoder(ids, memory[..., :4])
    with pytest.raises(
        ValueError,
        match=r"`x` and `encoder_output` must have the same batch size. Received shapes: x=\(2, 7, 8\), "
        r"encoder_output=\(3, 6, 8\)",
    ):
        decoder(ids[:2], memory)
    with pytest.raises(ValueError, match=r"`output_target` must be at most sequence_length=7 tokens long"):
        decoder(target_ids(rng, t=T + 1), memory)
    with pytest.raises(ValueError, match=r"`output_target` must hold token ids in \[0, vocab_size=13\)"):
        decoder(np.full((B, T), VOCAB), memory)
