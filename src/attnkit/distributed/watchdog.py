"""A stuck collective becomes a one-line error and exit status 1, never a hang or an abort.

A collective that waits for a process that died, or that an overloaded machine starves, blocks inside
C++ where Python cannot interrupt it; some engines end it by aborting the process (XLA's CPU
rendezvous: exit 134 and a stack dump). A daemon thread watches the training steps instead: when none
has finished for `timeout` seconds it prints one line and ends the process with `os._exit(1)`.
The first step also compiles, so it gets `first_timeout` (docs/decisions.md item 43).
"""

import os
import sys
import threading
import time

import keras

# Seconds allowed between two training steps, and for the first one, which compiles.
STEP_SECONDS, FIRST_STEP_SECONDS = 60, 300


class StepWatchdog(keras.callbacks.Callback):
    """A Keras callback that ends the process when no training step finishes in time.

    Args:
        who: names the process in the message, e.g. "worker 1 of 2".
        timeout: seconds allowed between two steps.
        first_timeout: seconds allowed for the first step of the run (it compiles).
    """

    def __init__(self, who, timeout, first_timeout):
        super().__init__()
        self.who, self.timeout, self.first_timeout = who, timeout, first_timeout
        self._last, self._limit = time.monotonic(), first_timeout
        self._lock, self._stop = threading.Lock(), threading.Event()

    def on_train_begin(self, logs=None):
        with self._lock:
            self._last = time.monotonic()
        self._stop.clear()
        threading.Thread(target=self._watch, daemon=True, name="attnkit-step-watchdog").start()

    def on_train_batch_end(self, batch, logs=None):
        with self._lock:
            self._last, self._limit = time.monotonic(), self.timeout

    def on_train_end(self, logs=None):
        self._stop.set()

    def _watch(self):
        while not self._stop.wait(0.5):
            with self._lock:
                waited = time.monotonic() - self._last
                stuck = waited > self._limit
            if stuck:
                sys.stdout.flush()
                sys.stderr.write(
                    f"attnkit: error: {self.who}: no training step finished in {waited:.0f} s: a collective is "
                    f"stuck (another process died or cannot be reached, or the machine is overloaded)\n"
                )
                sys.stderr.flush()
                os._exit(1)


class Deadline:
    """A context manager that ends the process with one line when its block takes over `seconds`.

    For joining a run: an engine may wait for an unreachable coordinator longer than asked, or abort.

    Args:
        message: the error line (without the "attnkit: error: " prefix).
        seconds: the time allowed.
    """

    def __init__(self, message, seconds):
        self.message, self.seconds = message, seconds
        self._done = threading.Event()

    def __enter__(self):
        threading.Thread(target=self._watch, daemon=True, name="attnkit-deadline").start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        return False

    def _watch(self):
        if not self._done.wait(self.seconds):
            sys.stdout.flush()
            sys.stderr.write(f"attnkit: error: {self.message}\n")
            sys.stderr.flush()
            os._exit(1)
