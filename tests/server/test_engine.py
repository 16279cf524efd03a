"""The continuous-batching engine: requests joining and leaving between steps give each its solo
tokens; sampling is per request; a cancelled request stops within one step; a model error fails only
its own request."""

import threading

import numpy as np
import pytest

from attnkit.server import engine as engine_module
from attnkit.server.engine import Engine, QueueFull
from attnkit.server.request import Generation
from serve_helpers import solo


def run(engine, lm, prompts, max_tokens, on_event=None, options=None):
    """Submits every prompt at once; returns their `Generation`s once all ended."""
    finished = threading.Semaphore(0)
    generations = []

    def emit_for(index):
        def emit(event):
            if on_event is not None:
                on_event(generations[index], event)
            if event.finish or event.error:
                finished.release()
        return emit

    for i, (prompt, length) in enumerate(zip(prompts, max_tokens)):
        generations.append(Generation(prompt, length, emit_for(i), lm.decode, stop_ids=lm.stop_ids, **(options or {}).get(i, {})))
    for g in generations:
        engine.submit(g)
    for _ in generations:
        assert finished.acquire(timeout=300)
    return generations


def test_batched_greedy_tokens_equal_each_request_served_alone(lm):
    rng = np.random.default_rng(1)
    # Lengths 1..70 and 3..25 new tokens with max_batch 3: requests join and leave at different steps,
    # prompts longer than the cache's filled slots make it shift, the slot run out and compact or grow.
    prompts = [list(rng.integers(0, 256, int(n))) for n in (1, 70, 5, 33, 2, 64)]
    lengths = [25, 3, 12, 7, 20, 4]
    engine = Engine(lm.model, max_batch=3, max_queue=16, pad_id=lm.pad_id)
    try:
        got = run(engine, lm, prompts, lengths)
    finally:
        engine.close()
    for g, prompt, n in zip(got, prompts, lengths):
        assert g.tokens == solo(lm, prompt, n)
    assert engine.steps < sum(lengths)  # steps were shared


def test_each_seed_gives_its_own_tokens_whatever_shares_the_batch(lm):
    prompts = [[5, 6, 7], [100, 3], [42] * 11]
    options = {0: dict(temperature=0.9, top_p=0.8, seed=7), 1: dict(temperature=1.3, seed=3), 2: dict(temperature=0.7, seed=11)}
    engine = Engine(lm.model, max_batch=4, max_queue=8, pad_id=lm.pad_id)
    try:
        together = [g.tokens for g in run(engine, lm, prompts, [10, 10, 10], options=options)]
        alone = [run(engine, lm, [prompts[0]], [10], options={0: options[0]})[0].tokens]
    finally:
        engine.close()
    assert together[0] == alone[0] == solo(lm, prompts[0], 10, temperature=0.9, top_p=0.8, seed=7)
    for i in (1, 2):
        assert together[i] == solo(lm, prompts[i], 10, **options[i])


def test_a_cancelled_request_takes_no_further_step(lm):
    def on_event(generation, event):
        if len(generation.tokens) == 3 and generation.prompt == [9, 9]:
            generation.cancelled = True  # as a handler does when its client goes away

    engine = Engine(lm.model, max_batch=4, max_queue=8, pad_id=lm.pad_id)
    done = threading.Event()
    try:
        cancelled, kept = Generation([9, 9], 50, lambda e: on_event(cancelled, e), lm.decode), None
        kept = Generation([1, 2, 3], 12, lambda e: done.set() if e.finish else None, lm.decode)
        engine.submit(cancelled)
        engine.submit(kept)
        assert done.wait(120)
        assert len(cancelled.tokens) == 3 and not cancelled.done  # dropped before the next step
        assert engine.busy() == 0
        assert kept.tokens == solo(lm, [1, 2, 3], 12)
    finally:
        engine.close()


def test_a_model_error_fails_its_own_request_only(lm, monkeypatch):
    poison = 255
    clean = [[4, 8, 15], [16, 23, 42, 7]]
    # The token the first clean prompt's neighbour generates third: a decoding step fails on it.
    victim = [77, 78]
    bad_step = solo(lm, victim, 6)[2]
    assert all(bad_step not in solo(lm, p, 6) and bad_step not in p for p in clean)
    real = engine_module.call_model

    def failing(model, ids, **options):
        values = np.asarray(ids)
        if poison in values or (values.shape[1] == 1 and bad_step in values):
            raise ValueError("injected fault")
        return real(model, ids, **options)

    monkeypatch.setattr(engine_module, "call_model", failing)
    engine = Engine(lm.model, max_batch=4, max_queue=8, pad_id=lm.pad_id)
    events = {}
    try:
        prompts = [[1, poison, 3], victim] + clean
        got = run(engine, lm, prompts, [6] * 4, on_event=lambda g, e: events.setdefault(id(g), []).append(e))
    finally:
        engine.close()
    assert "injected fault" in events[id(got[0])][-1].error and got[0].tokens == []  # its prefill failed
    assert "injected fault" in events[id(got[1])][-1].error and len(got[1].tokens) == 3  # its third step failed
    for g, prompt in zip(got[2:], clean):
        assert events[id(g)][-1].finish == "length" and g.tokens == solo(lm, prompt, 6)


def test_a_full_queue_is_refused(lm):
    engine = Engine(lm.model, max_batch=1, max_queue=1, pad_id=lm.pad_id)
    release = threading.Event()
    try:
        engine.call(release.wait)  # the engine's thread waits: nothing is admitted
        engine.submit(Generation([1], 2, lambda e: None, lm.decode))
        with pytest.raises(QueueFull, match="max-queue 1"):
            engine.submit(Generation([1], 2, lambda e: None, lm.decode))
    finally:
        release.set()
        engine.close()


def test_a_closing_engine_takes_no_new_request_and_finishes_those_running(lm):
    from attnkit.server.engine import Closed

    engine = Engine(lm.model, max_batch=2, max_queue=4, pad_id=lm.pad_id)
    done = threading.Event()
    running = Generation([3, 4], 5, lambda e: done.set() if e.finish else None, lm.decode)
    engine.submit(running)
    engine.close(timeout=60)
    assert done.is_set() and running.tokens == solo(lm, [3, 4], 5)
    with pytest.raises(Closed, match="shutting down"):
        engine.submit(Generation([1], 2, lambda e: None, lm.decode))



@pytest.mark.parametrize("stop, tail, text, finish", [
    (["\ufffd"], "€!", "é€!", "length"),  # each incomplete character decodes to U+FFFD for a token: not a stop
    (["€"], "€!", "é", "stop"),
    (["\ufffd"], None, "é", "stop"),  # a lone continuation byte then "a": U+FFFD for good, a stop
])
def test_a_stop_string_is_sought_in_whole_characters_only(lm, stop, tail, text, finish):
    encode = lambda s: lm.encode(s, add_special_tokens=False)  # noqa: E731 - byte-level: one id a byte
    ids = encode("é") + (encode(tail) if tail else [encode("©")[1]] + encode("a"))
    events = []
    generation = Generation([1], len(ids), events.append, lm.decode, stop=stop)
    for token in ids:
        if not generation.done:
            generation.accept(token)
    assert "".join(e.piece for e in events) == text and events[-1].finish == finish
