"""Tests for greedy_decode and beam_search: cached equals uncached, agreement with the model, end tokens, args."""

import numpy as np
import pytest

from attnkit.models.decoding import beam_search, greedy_decode
from attnkit.models.transformer import Transformer
from backend_utils import to_numpy

B, S, T, SRC_VOCAB, TGT_VOCAB, H, D, D_FF, N = 3, 6, 5, 11, 13, 2, 8, 16, 2  # T: at most 4 decoding steps
PAD, START, END = 0, 1, 2


def make_model(**kwargs):
    model = Transformer(SRC_VOCAB, TGT_VOCAB, S, T, H, D // H, D // H, D, D_FF, N, 0.0, **kwargs)
    model((source_ids(np.random.default_rng(0)), np.full((B, 1), START)))  # builds it
    return model


def source_ids(rng, lengths=(6, 4, 2)):
    ids = rng.integers(3, SRC_VOCAB, (len(lengths), S))
    for row, length in enumerate(lengths):
        ids[row, length:] = PAD
    return ids


def shift_output_bias(model, shifts):
    """Adds `shifts` {token: value} to the output layer's bias."""
    kernel, bias = model.model_last_layer.get_weights()
    for token, value in shifts.items():
        bias[token] += value
    model.model_last_layer.set_weights([kernel, bias])


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_cached_decoding_equals_uncached(rng, norm_first):
    model, src = make_model(norm_first=norm_first), source_ids(rng)
    cached = greedy_decode(model, src, use_cache=True, return_attention_weights=True)
    uncached = greedy_decode(model, src, use_cache=False, return_attention_weights=True)
    np.testing.assert_array_equal(cached.ids, uncached.ids)
    assert cached.step_logits.shape == (B, cached.ids.shape[1], TGT_VOCAB)
    np.testing.assert_allclose(cached.step_logits, uncached.step_logits, atol=1e-5)
    np.testing.assert_allclose(cached.scores, uncached.scores, atol=1e-5)
    assert len(cached.cross_attention) == N
    for ours, theirs in zip(cached.cross_attention, uncached.cross_attention):
        assert ours.shape == (B, H, cached.ids.shape[1], S)
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
        assert np.all(ours[1][..., 4:] == 0) and np.all(ours[2][..., 2:] == 0)  # source padding unseen
    beams = beam_search(model, src, beam_size=2, use_cache=True)
    uncached_beams = beam_search(model, src, beam_size=2, use_cache=False)
    np.testing.assert_array_equal(beams.ids, uncached_beams.ids)
    np.testing.assert_allclose(beams.scores, uncached_beams.scores, atol=1e-5)


def test_greedy_step_logits_are_the_model_logits_of_the_prefix(rng):
    model, src = make_model(), source_ids(rng)
    shift_output_bias(model, {PAD: -30.0, END: -30.0})  # no padding or end token: every step is comparable
    decoded = greedy_decode(model, src)
    assert decoded.ids.shape == (B, T)
    prefix = np.concatenate([np.full((B, 1), START), decoded.ids[:, :-1]], axis=1)
    logits = to_numpy(model((src, prefix)))
    np.testing.assert_allclose(decoded.step_logits, logits, atol=1e-5)
    np.testing.assert_array_equal(decoded.ids, logits.argmax(-1))
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = np.take_along_axis(log_probs, decoded.ids[..., None], -1).sum((1, 2))
    np.testing.assert_allclose(decoded.scores, want, atol=1e-4)


def test_beam_search_scores_at_least_greedy_and_beam_one_is_greedy(rng):
    model, src = make_model(), source_ids(rng)
    greedy = greedy_decode(model, src)
    one = beam_search(model, src, beam_size=1)
    np.testing.assert_array_equal(one.ids, greedy.ids)
    np.testing.assert_allclose(one.scores, greedy.scores, atol=1e-5)
    wide = beam_search(model, src, beam_size=2, length_penalty=0.0)
    assert np.all(wide.scores >= greedy.scores - 1e-5)


def test_greedy_pads_after_the_end_token(rng):
    model, src = make_model(), source_ids(rng)
    shift_output_bias(model, {PAD: -30.0})  # the model never picks the padding id itself
    # Lift the end token just enough that it wins the first step for some sources but not others.
    first = to_numpy(model((src, np.full((B, 1), START))))[:, 0]  # (B, V)
    gap = np.delete(first, END, axis=1).max(1) - first[:, END]  # (B,) how far END is from winning
    order = np.argsort(gap)
    lift = (gap[order[0]] + gap[order[1]]) / 2  # between the smallest gap and the next
    shift_output_bias(model, {END: lift})
    decoded = greedy_decode(model, src)
    ended_first = order[0]
    assert decoded.ids[ended_first, 0] == END
    np.testing.assert_array_equal(decoded.ids[ended_first, 1:], PAD)
    others = np.delete(np.arange(B), ended_first)
    assert np.all(decoded.ids[others, 0] != END)
    for row in decoded.ids:  # everything after the first end token is padding, everywhere
        ends = np.flatnonzero(row == END)
        if ends.size:
            np.testing.assert_array_equal(row[ends[0] + 1:], PAD)
        assert np.all(row[: ends[0] if ends.size else None] != PAD)
    lifted = to_numpy(model((src, np.full((B, 1), START))))[:, 0]  # (B, V) after the lift
    np.testing.assert_allclose(decoded.step_logits[:, 0], lifted, atol=1e-5)
    log_probs = lifted[ended_first] - np.log(np.exp(lifted[ended_first]).sum())
    np.testing.assert_allclose(decoded.scores[ended_first], log_probs[END], atol=1e-5)  # nothing after the end


def test_decoding_stops_when_every_sequence_has_ended(rng):
    model, src = make_model(), source_ids(rng)
    shift_output_bias(model, {END: 50.0})
    greedy = greedy_decode(model, src)
    np.testing.assert_array_equal(greedy.ids, np.full((B, 1), END))
    assert greedy.step_logits.shape == (B, 1, TGT_VOCAB)
    # The second beam of each source has to end too (one step later); the ended best one is padded.
    beams = beam_search(model, src, beam_size=2)
    np.testing.assert_array_equal(beams.ids, np.tile([END, PAD], (B, 1)))


@pytest.mark.parametrize(
    "decode,kwargs,message",
    [
        (greedy_decode, dict(max_length=T + 1), r"`max_length` must be at most dec_seq_length = 5. Received: max_length=6"),
        (beam_search, dict(max_length=T + 1), r"`max_length` must be at most dec_seq_length = 5. Received: max_length=6"),
        (greedy_decode, dict(start_id=PAD), r"`start_id` must differ from the model's pad_id \(0\)"),
        (beam_search, dict(start_id=PAD), r"`start_id` must differ from the model's pad_id \(0\)"),
        (greedy_decode, dict(start_id=None), r"`start_id` must be an integer token id. Received: start_id=None"),
        (greedy_decode, dict(end_id=1.5), r"`end_id` must be an integer token id. Received: end_id=1.5"),
        (beam_search, dict(length_penalty="a"), r"`length_penalty` must be a number >= 0. Received: length_penalty='a'"),
        (greedy_decode, dict(max_length=0), r"`max_length` must be a positive integer. Received: max_length=0"),
        (greedy_decode, dict(start_id=TGT_VOCAB), r"`start_id` must be a token id in \[0, 13\). Received: start_id=13"),
        (beam_search, dict(start_id=-1), r"`start_id` must be a token id in \[0, 13\). Received: start_id=-1"),
        (greedy_decode, dict(end_id=99), r"`end_id` must be a token id in \[0, 13\). Received: end_id=99"),
        (beam_search, dict(beam_size=0), r"`beam_size` must be a positive integer. Received: beam_size=0"),
        (beam_search, dict(length_penalty=-0.5), r"`length_penalty` must be >= 0. Received: length_penalty=-0.5"),
    ],
)
def test_bad_arguments_raise(rng, decode, kwargs, message):
    model = make_model()
    with pytest.raises(ValueError, match=message):
        decode(model, source_ids(rng), **kwargs)


def test_bad_model_or_source_raise(rng):
    with pytest.raises(TypeError, match="`model` must be an attnkit Transformer. Received: model of type str"):
        greedy_decode("model", source_ids(rng))
    with pytest.raises(ValueError, match=r"`encoder_input` must be \(B, S\) integer token ids. Received: shape \(6,\)"):
        greedy_decode(make_model(), source_ids(rng)[0])


@pytest.mark.parametrize("tie_weights", [False, True])
def test_decoding_builds_an_unbuilt_model(rng, tie_weights):
    """Decoding a model that was never called builds all of it: it can be called afterwards, and agrees."""
    model = Transformer(SRC_VOCAB, TGT_VOCAB, S, T, H, D // H, D // H, D, D_FF, N, 0.0, tie_weights=tie_weights)
    src = source_ids(rng)
    decoded = greedy_decode(model, src)
    assert model.built
    prefix = np.concatenate([np.full((B, 1), START), decoded.ids[:, :-1]], axis=1)
    logits = to_numpy(model((src, prefix)))
    # Comparable steps: not after an end token, nor after a generated padding id, which decoding keeps
    # as a real token and the model's call hides (`_Stepper`; a GPU's initial weights generated some).
    after = np.cumsum(np.isin(decoded.ids, [END, PAD]), axis=1) - np.isin(decoded.ids, [END, PAD]) > 0
    assert not after[:, 0].any()
    np.testing.assert_allclose(logits[~after], decoded.step_logits[~after], atol=1e-5)


def test_max_length_limits_the_output(rng):
    model, src = make_model(), source_ids(rng)
    shift_output_bias(model, {END: -30.0})
    assert greedy_decode(model, src, max_length=3).ids.shape == (B, 3)
    assert beam_search(model, src, beam_size=2, max_length=2).ids.shape == (B, 2)
    # dec_seq_length tokens at most, the default: the last one needs no position of its own
    assert greedy_decode(model, src).ids.shape == (B, T)
    assert beam_search(model, src, beam_size=2).ids.shape == (B, T)
