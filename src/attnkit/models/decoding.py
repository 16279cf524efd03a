"""Autoregressive decoding for `Transformer`: greedy and beam search, with or without a key/value cache.

With the cache, each step runs the decoder on the newest token only: the self-attention keys and
values of earlier positions are kept per layer in a `KVCache` (B, h, sequence_length, d_k), and the
cross-attention keys and values of the encoder output are computed once. Without it, each step reruns the decoder on the whole
prefix. Both give the same results (tested); the cache makes a step O(t) instead of O(t^2).

Legend: B batch, K beam size, S source length, t decoded positions so far, V vocabulary size.
"""

import numbers
from dataclasses import dataclass, field

import numpy as np
from keras import ops

from attnkit._validation import ArgumentTypeError, positive_int
from attnkit.models.transformer import Transformer


@dataclass
class Decoded:
    """The result of decoding.

    Attributes:
        ids: (B, T_out) int array of the generated tokens (no start token; padded with `pad_id` after
            the end token).
        scores: (B,) total log-probability of each sequence (beam search: before the length penalty).
        step_logits: (B, T_out, V) float32 logits of every step (greedy only; None for beam search).
        cross_attention: when asked (greedy only), one (B, h, T_out, S) array per decoder layer.
    """

    ids: np.ndarray
    scores: np.ndarray
    step_logits: np.ndarray = None
    cross_attention: list = field(default=None)


def _numpy(x):
    if hasattr(x, "detach"):
        x = x.detach()
    return np.asarray(ops.convert_to_numpy(x))


def _log_softmax(logits):
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _check(model, source, max_length, start_id, end_id):
    """Validates the arguments, builds an unbuilt `model` for `source` (B, S); returns max_length."""
    if not isinstance(model, Transformer):
        raise ArgumentTypeError(f"`model` must be an attnkit Transformer. Received: model of type {type(model).__name__}")
    limit = model.decoder.sequence_length  # positions 0..limit-1 hold the start token and all but the last
    max_length = limit if max_length is None else positive_int("max_length", max_length)
    if max_length > limit:
        raise ValueError(f"`max_length` must be at most dec_seq_length = {limit}. Received: max_length={max_length}")
    for name, value in (("start_id", start_id), ("end_id", end_id)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ArgumentTypeError(f"`{name}` must be an integer token id. Received: {name}={value!r}")
        if not 0 <= value < model.decoder.vocab_size:
            raise ValueError(f"`{name}` must be a token id in [0, {model.decoder.vocab_size}). Received: {name}={value}")
    if start_id == model.pad_id:
        # Teacher forcing hides target tokens equal to pad_id, the start token too; decoding hides none.
        raise ValueError(
            f"`start_id` must differ from the model's pad_id ({model.pad_id}): the decoder hides padding "
            f"tokens in training, so the model never saw its start token. Received: start_id={start_id}"
        )
    if len(source.shape) != 2 or not np.issubdtype(source.dtype, np.integer):
        raise ValueError(
            f"`encoder_input` must be (B, S) integer token ids. Received: shape {source.shape}, dtype {source.dtype}"
        )
    if not model.built:
        model.build(source.shape, (source.shape[0], 1))
    return max_length


def _empty(model, source, *, with_weights, greedy=True):
    """The `Decoded` of an empty batch (0, S): no sequences, so no steps (docs/decisions.md item 25)."""
    decoder = model.decoder
    cross = [np.zeros((0, decoder.h, 0, source.shape[1]), np.float32) for _ in range(decoder.n)]
    return Decoded(
        np.zeros((0, 0), np.int32), np.zeros(0),
        np.zeros((0, 0, decoder.vocab_size), np.float32) if greedy else None,
        cross if with_weights else None,
    )


class _Stepper:
    """Next-token logits for a growing batch of prefixes, cached or not."""

    def __init__(self, model, encoder_input, use_cache, repeat=1, with_weights=False):
        self.model, self.use_cache, self.with_weights = model, use_cache, with_weights
        encoder_output, source_mask = model.encode(encoder_input, training=False)
        if repeat > 1:  # (B, ...) -> (B * K, ...), each source K times in a row
            encoder_output = ops.repeat(encoder_output, repeat, axis=0)
            source_mask = None if source_mask is None else ops.repeat(source_mask, repeat, axis=0)
        self.encoder_output, self.source_mask = encoder_output, source_mask
        self.cross = model.decoder.project_encoder_output(encoder_output) if use_cache else None
        self.cache = model.decoder.new_cache(encoder_output.shape[0]) if use_cache else None

    def __call__(self, prefix):
        """`prefix` (N, t) ids -> (N, V) logits of the next token, and the newest cross weights."""
        decoder, weights = self.model.decoder, None
        if self.use_cache:
            result = decoder.decode_step(
                prefix[:, -1:], self.cache, self.cross, self.source_mask, return_attention_weights=self.with_weights
            )
            y, weights = result if self.with_weights else (result, None)  # weights: n x (N, h, 1, S)
        else:
            # Every prefix token is real, even a generated padding id: hide none, as the cache does not.
            every_token = np.ones((prefix.shape[0], 1, prefix.shape[1]), dtype=bool)  # (N, 1, t): never ambiguous
            result = decoder(
                prefix, self.encoder_output, every_token, self.source_mask, training=False,
                return_attention_weights=self.with_weights,
            )
            y = result[0] if self.with_weights else result
            if self.with_weights:
                weights = [w[:, :, -1:] for w in result[2]]  # n x (N, h, 1, S)
            y = y[:, -1:]
        return _numpy(self.model.logits(y))[:, -1], weights

    def reorder(self, rows):
        """Keeps the cache rows `rows` (N,), in that order (beam search)."""
        if self.cache is not None:
            self.cache.reorder(rows)


def greedy_decode(model, encoder_input, *, max_length=None, start_id=1, end_id=2, use_cache=True,
                  return_attention_weights=False):
    """Picks the most likely next token at every step until `end_id` or `max_length`.

    Args:
        model: a `Transformer`.
        encoder_input: (B, S) source ids.
        max_length: the most tokens to generate, at most (and by default) dec_seq_length.
        start_id, end_id: the target start and end tokens; start_id must differ from the model's pad_id.
        use_cache: keep the key/value cache (default) or rerun the decoder on the whole prefix.
        return_attention_weights: also collect the cross-attention weights of every layer.

    Returns:
        `Decoded` with ids (B, T_out), scores (B,), step_logits (B, T_out, V) and, when asked,
        cross_attention: n arrays (B, h, T_out, S). An empty batch (B = 0) takes no step: T_out = 0.
    """
    source = _numpy(ops.convert_to_tensor(encoder_input))
    max_length = _check(model, source, max_length, start_id, end_id)
    B, pad_id = source.shape[0], model.pad_id or 0
    if B == 0:
        return _empty(model, source, with_weights=return_attention_weights)
    stepper = _Stepper(model, source, use_cache, with_weights=return_attention_weights)
    prefix = np.full((B, 1), start_id, dtype=np.int32)
    done = np.zeros(B, dtype=bool)
    scores = np.zeros(B)
    step_logits, cross = [], []
    for _ in range(max_length):
        logits, weights = stepper(prefix)  # (B, V)
        token = logits.argmax(-1).astype(np.int32)
        scores += np.where(done, 0.0, _log_softmax(logits)[np.arange(B), token])
        token = np.where(done, pad_id, token)
        prefix = np.concatenate([prefix, token[:, None]], axis=1)
        step_logits.append(logits)
        if weights is not None:
            cross.append([_numpy(w) for w in weights])
        done |= token == end_id
        if done.all():
            break
    cross_attention = [np.concatenate(per_layer, axis=2) for per_layer in zip(*cross)] if cross else None
    return Decoded(prefix[:, 1:], scores, np.stack(step_logits, axis=1).astype(np.float32), cross_attention)


def beam_search(model, encoder_input, *, beam_size=4, max_length=None, start_id=1, end_id=2, length_penalty=0.6,
                use_cache=True):
    """Keeps the `beam_size` most likely prefixes at every step; returns the best finished one.

    Finished beams are scored by log-probability / ((5 + length) / 6) ** length_penalty (Wu et al.
    2016), the normalisation most translation systems use; `length_penalty=0` compares raw sums.

    Args:
        model: a `Transformer`.
        encoder_input: (B, S) source ids.
        beam_size: K, the number of prefixes kept. Default 4.
        max_length, start_id, end_id, use_cache: as in `greedy_decode`.
        length_penalty: alpha above, >= 0. Default 0.6.

    Returns:
        `Decoded` with ids (B, T_out) and scores (B,) (the total log-probability of the chosen beam).
        An empty batch (B = 0) takes no step: ids (0, 0), scores (0,).
    """
    source = _numpy(ops.convert_to_tensor(encoder_input))
    max_length = _check(model, source, max_length, start_id, end_id)
    K = positive_int("beam_size", beam_size)
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, numbers.Real):
        raise ArgumentTypeError(f"`length_penalty` must be a number >= 0. Received: length_penalty={length_penalty!r}")
    if not float(length_penalty) >= 0:
        raise ValueError(f"`length_penalty` must be >= 0. Received: length_penalty={length_penalty}")
    B, pad_id = source.shape[0], model.pad_id or 0
    if B == 0:
        return _empty(model, source, with_weights=False, greedy=False)
    stepper = _Stepper(model, source, use_cache, repeat=K)
    prefix = np.full((B * K, 1), start_id, dtype=np.int32)
    scores = np.full((B, K), -np.inf)
    scores[:, 0] = 0.0  # all beams start equal: let only the first one expand at step 0
    done = np.zeros((B, K), dtype=bool)
    lengths = np.zeros((B, K))
    for _ in range(max_length):
        logits, _ = stepper(prefix)
        log_probs = _log_softmax(logits).reshape(B, K, -1)  # (B, K, V)
        V = log_probs.shape[-1]
        # A finished beam extends only with padding, at no cost, so it keeps its score.
        finished = np.full(V, -np.inf)
        finished[pad_id] = 0.0
        log_probs = np.where(done[..., None], finished, log_probs)
        candidates = (scores[..., None] + log_probs).reshape(B, K * V)  # (B, K * V)
        best = np.argsort(-candidates, axis=1, kind="stable")[:, :K]  # (B, K)
        beam, token = best // V, (best % V).astype(np.int32)
        rows = (np.arange(B)[:, None] * K + beam).reshape(-1)  # (B * K,) rows of the old beams
        scores = np.take_along_axis(candidates, best, axis=1)
        lengths = np.take_along_axis(lengths, beam, axis=1) + ~np.take_along_axis(done, beam, axis=1)
        done = np.take_along_axis(done, beam, axis=1) | (token == end_id)
        prefix = np.concatenate([prefix[rows], token.reshape(-1, 1)], axis=1)
        stepper.reorder(rows)
        if done.all():
            break
    normalised = scores / ((5.0 + lengths) / 6.0) ** float(length_penalty)
    normalised = np.where(np.isfinite(scores), normalised, -np.inf)
    chosen = normalised.argmax(axis=1)  # (B,)
    ids = prefix.reshape(B, K, -1)[np.arange(B), chosen, 1:]
    return Decoded(ids, scores[np.arange(B), chosen])
