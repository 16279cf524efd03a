"""Continuous batching: one thread owns the model and runs every request's decoding steps together
(docs/decisions.md item 115).

    loop:  drop cancelled rows; admit waiting requests (prefill each alone, place its cache row);
           one step for every active row: (b, 1) tokens -> (b, V) logits; each row picks its token

One `KVCache` of `max_batch` rows holds the active sequences; rows [0, b) are active, so a step runs
on a view of them (torch: views written in place). Every row writes its new token at the same slot,
`length`; a row attends only to its own valid slots and its positions come from its own count of
tokens (`KVCache.seen`), so rows of different lengths share steps with no padding computed: a
prompt is prefilled alone in a cache of its own and its slots are copied into a free row, ending
just before `length`. When slots run out, rows are compacted (each row's valid slots moved
together) or the cache grows.

The HTTP handlers only enqueue (`submit`) and read their request's events; `call` runs other work
(the explorer's) in this thread between steps: Keras models are not thread-safe.

Legend: b active rows, P prompt tokens, V vocabulary, L the cache's filled slots.
"""

import collections
import concurrent.futures
import threading
import time

import keras
import numpy as np
from keras import ops

from attnkit.models.generation import call_model


class QueueFull(Exception):
    """The engine has `max_queue` requests waiting."""


class Closed(Exception):
    """The engine is shutting down and takes no new request."""


def _room(length):
    return -(-length // 64) * 64  # slots rounded up to 64: jax and tensorflow compile per cache shape


class Engine:
    """Runs `Generation`s on a `CausalLM` with continuous batching, in a thread of its own.

    Args:
        model: the `CausalLM`.
        max_batch: the most sequences decoded together.
        max_queue: the most requests waiting for a row; `submit` raises `QueueFull` beyond.
        pad_id: the id padding a prefill's left side (jax and tensorflow: prompt lengths bucketed to
            multiples of 32, so a prefill compiles once per bucket, not per length).
    """

    def __init__(self, model, *, max_batch=8, max_queue=64, pad_id=0):
        self.model, self.max_batch, self.max_queue, self.pad_id = model, max_batch, max_queue, pad_id
        self.bucket = 32 if keras.backend.backend() in ("jax", "tensorflow") else 1
        self.waiting = collections.deque()
        self.jobs = collections.deque()  # (callable, Future) run between steps
        self.rows = []  # the active `Generation`s; rows[i] is cache row i
        self.admitting = 0  # 1 while a request taken from `waiting` is prefilled (in neither list)
        self.cache = None
        self.steps = 0
        self.condition = threading.Condition()
        self.closing = False
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="attnkit-engine", daemon=True)
        self.thread.start()

    # The handlers' side.

    def submit(self, generation):
        """Queues `generation`; raises `QueueFull` or `Closed`."""
        with self.condition:
            if self.closing:
                raise Closed("The server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"{len(self.waiting)} requests are waiting (--max-queue {self.max_queue})")
            self.waiting.append(generation)
            self.condition.notify()

    def call(self, function):
        """Runs `function()` in the engine's thread between steps; returns a `concurrent.futures.Future`."""
        future = concurrent.futures.Future()
        with self.condition:
            if self.closing:
                raise Closed("The server is shutting down")
            self.jobs.append((function, future))
            self.condition.notify()
        return future

    def busy(self):
        """Requests waiting or running."""
        with self.condition:
            return len(self.waiting) + len(self.rows) + self.admitting

    def close(self, timeout=30.0):
        """Takes no new request; lets those running and waiting finish for up to `timeout` seconds,
        fails the rest, and stops the thread."""
        with self.condition:
            self.closing = True
            self.condition.notify()
        deadline = time.monotonic() + timeout
        while self.busy() and time.monotonic() < deadline:
            time.sleep(0.01)
        with self.condition:
            self.stopped = True
            self.condition.notify()
        self.thread.join(timeout=max(deadline - time.monotonic(), 0) + 5)
        for generation in list(self.waiting) + list(self.rows):
            if not generation.done:
                generation.fail("The server shut down before this request finished")

    # The engine's thread.

    def _run(self):
        while True:
            with self.condition:
                while not (self.waiting or self.jobs or self.rows or self.stopped):
                    self.condition.wait()
                if self.stopped:
                    return
                jobs, self.jobs = list(self.jobs), collections.deque()
            for function, future in jobs:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(function())
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        future.set_exception(e)
            try:
                self._drop(lambda g: g.cancelled or g.done)
                self._admit()
                if self.rows:
                    self._step()
            except Exception as e:  # noqa: BLE001 - a fault of the engine's own: its requests fail, it goes on
                for generation in self.rows:
                    generation.fail(_message(e).replace("the model", "the server"))
                self.rows, self.cache = [], None

    def _admit(self):
        while len(self.rows) < self.max_batch:
            with self.condition:
                if not self.waiting:
                    return
                generation = self.waiting.popleft()
                self.admitting = 1
            try:
                if generation.cancelled:
                    continue
                try:
                    small = self._prefill(generation)
                except Exception as e:  # noqa: BLE001 - a model error fails this request only
                    generation.fail(_message(e))
                    continue
                if not generation.done:  # else its first token ended it
                    self._place(generation, small)
            finally:
                with self.condition:
                    self.admitting = 0

    def _prefill(self, generation):
        """Runs the prompt alone in a cache of its own; picks the first token; returns that cache."""
        prompt = generation.prompt
        pad = (-len(prompt)) % self.bucket
        ids = np.asarray([[self.pad_id] * pad + prompt], "int32")  # (1, pad + P)
        mask = np.asarray([[False] * pad + [True] * len(prompt)])
        small = self.model.new_cache(1, _room(ids.shape[1] + 1))
        logits = call_model(self.model, ids, attention_mask=mask, cache=small, last_only=True)
        generation.pick(ops.convert_to_numpy(logits)[0, -1])  # (V,)
        return small

    def _place(self, generation, small):
        n = small.length
        if self.cache is None:
            self.cache = self.model.new_cache(self.max_batch, _room(max(n + 1, 256)))
        cache = self.cache
        if not self.rows:
            cache.length = 0
            cache.valid[:] = False
        self._ensure(1, at_least=n)
        if cache.length < n:
            # Every active row gets invalid slots up to n: the new prompt's slots end at `length`.
            cache.valid[:, cache.length : n] = False
            cache.length = n
        cache.place(len(self.rows), small, 0, cache.length - n)
        self.rows.append(generation)

    def _ensure(self, new, at_least=0):
        """Room for `new` slots after max(length, at_least): compacting first, growing if that is not
        enough. Compacts too when over half the filled slots are invalid (they cost attention)."""
        cache, b = self.cache, len(self.rows)
        held = int(cache.valid[:b, : cache.length].sum(axis=1).max()) if b else 0
        if max(cache.length, at_least) + new > cache.max_length or (cache.length > 64 and held < cache.length // 2):
            cache.compact(b)
        need = max(cache.length, at_least) + new
        if need > cache.max_length:
            cache.grow(_room(max(need, 2 * cache.max_length)))

    def _step(self):
        """One decoding step of every active row; a failing step is retried row by row, so a model
        error fails only the rows it comes from."""
        cache, b = self.cache, len(self.rows)
        self._ensure(1)
        saved = cache.length, cache.valid[:b].copy(), cache.seen[:b].copy()
        try:
            # jax and tensorflow: every row steps (the free ones on a padding token of their own), so a
            # step compiles once per cache shape rather than once per batch size too.
            logits = self._forward(0, self.max_batch if self.bucket > 1 else b)[:b]  # (b, V)
        except Exception:  # noqa: BLE001 - find the rows that fail
            logits = None
        if logits is None:
            cache.length, cache.valid[:b], cache.seen[:b] = saved
            outputs = []
            for row in range(b):
                cache.length = saved[0]
                try:
                    outputs.append(self._forward(row, row + 1)[0])
                except Exception as e:  # noqa: BLE001 - fails this row's request only
                    outputs.append(None)
                    self.rows[row].fail(_message(e))
            cache.length = saved[0] + 1
        else:
            outputs = list(logits)
        self.steps += 1
        for generation, row_logits in zip(self.rows, outputs):
            if generation.done or generation.cancelled:
                continue
            try:
                generation.pick(row_logits)
            except Exception as e:  # noqa: BLE001 - non-finite logits fail this request only
                generation.fail(_message(e))

    def _forward(self, start, stop):
        """Logits (stop - start, V) of rows [start, stop) for their last tokens, written at slot `length`."""
        ids = np.asarray([[self.rows[r].last if r < len(self.rows) else self.pad_id] for r in range(start, stop)], "int32")  # (b, 1)
        view = self.cache.rows(start, stop)
        logits = call_model(self.model, ids, attention_mask=np.ones(ids.shape, bool), cache=view, last_only=True)
        logits = ops.convert_to_numpy(logits)[:, -1]  # (b, V)
        self.cache.merge_rows(view, start)
        return logits

    def _drop(self, finished):
        """Frees the rows of finished or cancelled requests; the last active row moves into each hole."""
        row = 0
        while row < len(self.rows):
            if not finished(self.rows[row]):
                row += 1
                continue
            last = len(self.rows) - 1
            if row != last:
                self.cache.place(row, self.cache, last, 0)  # (its slots [0, length): where they are)
            self.rows[row] = self.rows[last]
            self.rows.pop()


def _message(error):
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Exception encountered when calling")]
    return f"The model failed on this request: {type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
