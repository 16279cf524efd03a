"""Generation from a `CausalLM`: greedy or sampled, cached, batched with left padding, streamed.

Each step picks one token per sequence from the last position's logits: greedy (argmax) when the
temperature is 0, else a sample after the temperature, top-k and top-p filters, in that order (as
transformers applies them); a repetition penalty, when asked, comes first. Sampling runs in NumPy on float32 logits with `numpy.random.default_rng
(seed)`, so a seed gives the same tokens on every backend (docs/decisions.md item 36).

Prompts of different lengths are padded on the left, so every sequence's next token lands in the
same cache slot; padding takes no position and is never attended to. The cache holds the prompt and
at most `CACHE_ROOM` new tokens at first and doubles when full: a `max_new_tokens` far beyond what
a generation reaches before its stop token allocates nothing for it (docs/decisions.md item 86).

Legend: B prompts, P longest prompt, V vocabulary.
"""

import numbers
import warnings

import keras
import numpy as np
from keras import ops

from attnkit._validation import positive_int
from attnkit.layers._sublayer import call_sublayer
from attnkit.layers.kv_cache import KVCache
from attnkit.models.prompt_ids import check_prompts

CACHE_ROOM = 4096  # new tokens the first cache has room for; it doubles when full


def check_sampling(temperature, top_k, top_p):
    """Validates the sampling settings; returns them as (float, int or None, float or None)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not temperature >= 0:
        raise ValueError(f"`temperature` must be a number >= 0 (0: greedy). Received: temperature={temperature!r}")
    top_k = None if top_k is None else positive_int("top_k", top_k)
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
        raise ValueError(f"`top_p` must be a number in (0, 1]. Received: top_p={top_p!r}")
    return float(temperature), top_k, None if top_p is None else float(top_p)


def check_repetition_penalty(penalty):
    """`repetition_penalty`: a number > 0; 1 leaves the logits as they are."""
    if isinstance(penalty, bool) or not isinstance(penalty, numbers.Real) or not 0 < penalty < float("inf"):
        raise ValueError(f"`repetition_penalty` must be a finite number > 0 (1: none). Received: repetition_penalty={penalty!r}")
    return float(penalty)


def penalize_repetition(logits, seen, penalty):
    """transformers' repetition penalty (CTRL, Keskar et al. 2019): the logit of every token already in
    a row's sequence, prompt included, is divided by `penalty` where positive and multiplied where
    negative, before the temperature and the filters.

    Args:
        logits: (B, V) float array.
        seen: (B, V) bool, the tokens of each row's prompt and of what it generated.
        penalty: > 0.

    Returns:
        (B, V) float array."""
    logits = np.asarray(logits)
    return np.where(seen, np.where(logits < 0, logits * penalty, logits / penalty), logits)


def choose(logits, temperature=0.0, top_k=None, top_p=None, rng=None):
    """The next token of each row.

    Args:
        logits: (B, V) float array.
        temperature: 0 for greedy; else the logits are divided by it before sampling.
        top_k: keep only the k most likely tokens.
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p.
        rng: a `numpy.random.Generator` (sampling only).

    Returns:
        (B,) int64 token ids.
    """
    logits = np.asarray(logits, dtype="float64")
    if not np.all(np.isfinite(logits)):
        raise ValueError("The model returned non-finite logits (NaN or inf); refusing to pick a token from them.")
    if temperature == 0:
        return np.argmax(logits, axis=-1)
    # The largest logit subtracted first: logits / 1e-320 overflow to inf (inf - inf = NaN), their
    # differences only to -inf, whose probability is 0. A tiny temperature is then greedy sampling.
    with np.errstate(over="ignore"):
        logits = (logits - logits.max(axis=-1, keepdims=True)) / temperature  # (B, V), <= 0
    if top_k is not None and top_k < logits.shape[-1]:
        kth = np.sort(logits, axis=-1)[:, -top_k][:, None]  # (B, 1)
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1:
        order = np.argsort(-probs, axis=-1, kind="stable")  # (B, V) most likely first
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass of the more likely tokens
        keep_sorted = before < top_p  # the first token is always kept
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    u = rng.random((probs.shape[0], 1))
    picked = (np.cumsum(probs, axis=-1) < u).sum(axis=-1)
    return np.minimum(picked, probs.shape[-1] - 1)


def check_stop_tokens(stop_tokens):
    """`stop_tokens` as a list of ints: a token id (as transformers' `eos_token_id` takes one) or a
    sequence of them; an empty sequence stops nothing."""
    ids = [stop_tokens] if isinstance(stop_tokens, numbers.Integral) else stop_tokens
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"`stop_tokens` must be a token id or a list of token ids. Received: stop_tokens={stop_tokens!r}")
    ids = list(ids)
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
        raise TypeError(f"`stop_tokens` must be a token id or a list of token ids. Received: stop_tokens={stop_tokens!r}")
    return [int(t) for t in ids]


def check_seed(seed):
    """`seed`: None (fresh randomness) or an integer >= 0, what `numpy.random.default_rng` takes."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
        raise ValueError(f"`seed` must be None or an integer >= 0. Received: seed={seed!r}")
    return None if seed is None else int(seed)


def check_pad_id(pad_id, vocab_size):
    """`pad_id`: a token id in [0, vocab_size) (it is fed to the embedding, masked)."""
    if isinstance(pad_id, bool) or not isinstance(pad_id, numbers.Integral) or not 0 <= pad_id < vocab_size:
        raise ValueError(f"`pad_id` must be a token id in [0, vocab_size={vocab_size}). Received: pad_id={pad_id!r}")
    return int(pad_id)


def left_pad(prompts, pad_id):
    """(ids (B, P) int32, mask (B, P) bool) with every prompt right-aligned; prompts are checked
    (`prompt_ids.check_prompts`) and non-empty."""
    P = max(len(p) for p in prompts)
    ids = np.full((len(prompts), P), pad_id, dtype="int32")
    mask = np.zeros((len(prompts), P), dtype=bool)
    for row, prompt in enumerate(prompts):
        ids[row, P - len(prompt):] = prompt
        mask[row, P - len(prompt):] = True
    return ids, mask


def generate_tokens(
    model, prompts, *, max_new_tokens=32, temperature=0.0, top_k=None, top_p=None, repetition_penalty=1.0, seed=None,
    stop_tokens=(), pad_id=0, use_cache=True,
):
    """Yields the next token of every prompt, step by step.

    Args:
        model: a `CausalLM`.
        prompts: a list of B token id lists (lengths may differ; integers, or floats holding whole
            numbers, in [0, V); B = 0 yields nothing).
        max_new_tokens: the most tokens generated per prompt.
        temperature, top_k, top_p: see `choose`.
        repetition_penalty: see `penalize_repetition` (1: none).
        seed: int seed of the sampling (None: fresh randomness). top_k, top_p or seed given for greedy
            decoding (temperature 0) have no effect: a UserWarning says so.
        stop_tokens: ids that end a sequence (the stop token is yielded, then the row yields `pad_id`).
        pad_id: the id padding prompts and finished rows.
        use_cache: decode from a `KVCache` (default) or recompute the whole sequence each step.

    Yields:
        (B,) int64 arrays, one per step; after a row's stop token, `pad_id`. Ends when every row
        has stopped or after `max_new_tokens` steps.
    """
    max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
    temperature, top_k, top_p = check_sampling(temperature, top_k, top_p)
    penalty = check_repetition_penalty(repetition_penalty)
    seed, stop = check_seed(seed), set(check_stop_tokens(stop_tokens))
    prompts = check_prompts(prompts, model.vocab_size)  # whole numbers in [0, V), by name (item 106)
    pad_id = check_pad_id(pad_id, model.vocab_size)
    if temperature == 0:
        ignored = [f"{k}={v!r}" for k, v in (("top_k", top_k), ("top_p", top_p), ("seed", seed)) if v is not None]
        if ignored:  # as transformers warns: they shape only sampling (docs/decisions.md item 108)
            warnings.warn(
                f"{', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect: generation is greedy "
                "(temperature 0); give a temperature > 0 to sample", UserWarning, stacklevel=3,
            )
    if not prompts:
        return  # an empty batch: no steps (attnkit's rule for empty batches)
    rng = np.random.default_rng(seed) if temperature > 0 else None
    ids, mask = left_pad(prompts, pad_id)
    done = np.zeros((len(prompts),), dtype=bool)
    if penalty != 1:
        seen = np.zeros((len(prompts), model.vocab_size), dtype=bool)  # (B, V)
        for row, prompt in enumerate(prompts):
            seen[row, prompt] = True
    if use_cache:
        # Room rounded up to 64 slots: on jax and tensorflow a step's shapes are the cache's, so prompts
        # of similar lengths share one compiled step (docs/decisions.md item 56).
        cache = model.new_cache(len(prompts), _room(ids.shape[1] + min(max_new_tokens, CACHE_ROOM)))
        needed = ids.shape[1] + max_new_tokens - 1  # the last token is yielded, never fed back
        logits = call_model(model, ids, attention_mask=mask, cache=cache, last_only=True)
    else:
        logits = call_model(model, ids, attention_mask=mask, last_only=True)
    for step in range(max_new_tokens):
        last = ops.convert_to_numpy(logits)[:, -1]  # (B, V)
        if penalty != 1:
            last = penalize_repetition(last, seen, penalty)
        token = choose(last, temperature, top_k, top_p, rng)
        token = np.where(done, pad_id, token)
        if penalty != 1:
            seen[np.arange(len(prompts)), token] = True
        yield token
        done |= np.isin(token, list(stop)) if stop else False
        if done.all() or step == max_new_tokens - 1:
            return
        new = token[:, None].astype("int32")  # (B, 1)
        if use_cache:
            if cache.length == cache.max_length:
                cache = _grown(cache, _room(min(2 * cache.max_length, needed)))
            logits = call_model(model, new, attention_mask=np.ones_like(new, dtype=bool), cache=cache, last_only=True)
        else:
            ids, mask = np.concatenate([ids, new], axis=1), np.concatenate([mask, np.ones_like(new, dtype=bool)], axis=1)
            logits = call_model(model, ids, attention_mask=mask, last_only=True)


def _room(length):
    """`length` rounded up to a multiple of 64 slots."""
    return -(-length // 64) * 64


def _grown(cache, max_length):
    """A copy of `cache` with room for `max_length` tokens: its filled slots, then empty ones."""
    grown = KVCache.of_buffers(
        [_extended(k, max_length) for k in cache.keys], [_extended(v, max_length) for v in cache.values],
    )
    grown.length, grown.seen = cache.length, cache.seen
    grown.valid = np.zeros((cache.valid.shape[0], max_length), dtype=bool)
    grown.valid[:, : cache.max_length] = cache.valid
    return grown


def _extended(buffer, max_length):
    """(B, h_kv, S_max, d) -> (B, h_kv, max_length, d), zeros after the first S_max slots."""
    B, h, S, d = buffer.shape
    return ops.concatenate([buffer, ops.zeros((B, h, max_length - S, d), buffer.dtype)], axis=2)


def call_model(model, ids, **options):
    """`model(ids, **options)`, through `call_sublayer`: a decoding step repeats Keras's `__call__` work
    on the whole model (its losses cleared layer by layer, ~480 layers for SmolLM2) for nothing when
    the model needs none of it (docs/decisions.md item 58). On torch without an autograd graph:
    generation differentiates nothing, and the fused decoding step runs only then (item 143)."""
    if keras.backend.backend() == "torch":
        import torch

        with torch.no_grad():
            return call_sublayer(model, ops.convert_to_tensor(ids), **options)
    return call_sublayer(model, ops.convert_to_tensor(ids), **options)


def generate(model, prompts, *, on_token=None, **options):
    """Generates for every prompt; returns a list of B lists of new ids (each stop token included).

    Args:
        model, prompts, **options: as in `generate_tokens`.
        on_token: optional callable receiving each step's (B,) ids as they are chosen (streaming).
    """
    prompts = check_prompts(prompts, model.vocab_size)
    outputs = [[] for _ in prompts]
    finished = [False] * len(prompts)
    stop = set(check_stop_tokens(options.get("stop_tokens", ())))
    for token in generate_tokens(model, prompts, **options):
        if on_token is not None:
            on_token(token)
        for row, t in enumerate(token.tolist()):
            if not finished[row]:
                outputs[row].append(t)
                finished[row] = t in stop
    return outputs
