"""Ctrl-C that is never lost (docs/decisions.md item 57).

Python turns SIGINT into a KeyboardInterrupt raised wherever the main thread happens to be. Two places
lose it:
- a garbage-collector callback or a `__del__` (jax registers one, `_xla_gc_callback`): Python prints
  "Exception ignored in ..." and carries on, so a `train --force` pressed with Ctrl-C trained to the
  end and replaced the user's model;
- code the interrupt cuts short that raises its own error in its place: tensorflow's device scope
  ("RuntimeError: Exiting device scope without proper scope nesting"), NumPy 2's retry of a
  tensorflow variable's `__array__` (a TypeError).

And one place breaks on it: a KeyboardInterrupt raised inside tensorflow's own Python code (its
dataset iterators, say) can leave its C++ state half made, and the process dies later of a
segmentation fault or "free(): invalid next size" (seen in 2 of 15 interrupted trainings).

Before the command runs, while Python imports attnkit, Keras and the backend (seconds), a Ctrl-C raised
its KeyboardInterrupt inside whatever module was being imported: a traceback, or, inside a `__del__` or a
garbage-collector callback of those imports, nothing at all (the command then ran to its end). Nothing is
written before the command runs, so there the attnkit command ends at once, with one line and status 130
(`exit_on_ctrl_c_while_starting`, docs/decisions.md item 112).

So the CLI notes every SIGINT while it runs (`watching_ctrl_c`), still raising KeyboardInterrupt as
Python's own handler does, and asks at its points of no return (`raise_if_pressed`): before a save
commits, before an explorer export's rename, before the explorer starts serving, and when the
command ends. Around `fit`, the first Ctrl-C is only noted, and training stops
at the next batch's end, between the framework's steps (`ctrl_c_between_batches`); a second one
raises at once.
"""

import contextlib
import os
import signal
import threading

_pressed = False
_deferred = False  # inside `ctrl_c_between_batches`: the first Ctrl-C is only noted


def _exit_while_starting(signum, frame):
    try:
        os.write(2, b"attnkit: interrupted\n")
    finally:
        os._exit(130)


def exit_on_ctrl_c_while_starting():
    """Called by the attnkit command's first import (`attnkit._backend`): until `watching_ctrl_c` takes
    over, Ctrl-C ends the process at once with "attnkit: interrupted" and status 130. A SIGINT someone
    ignored (a background job, nohup) or handles is left alone."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_while_starting)


@contextlib.contextmanager
def watching_ctrl_c():
    """While the block runs, a SIGINT is noted and raises KeyboardInterrupt; so is a SIGTERM (`kill`),
    whose default action would end the process at once and leave a save's staging files behind.

    Only the main thread receives signals; a handler someone else installed (not Python's default)
    is left alone, and then nothing is noted (a `main` inside a `main` shares the outer one's note).
    The note is cleared when the block ends: code run after it (a library save) does not see it.
    """
    global _pressed

    def noting(signum, frame):
        global _pressed
        first, _pressed = not _pressed, True
        if not (first and _deferred):
            signal.default_int_handler(signum, frame)

    ours = threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _exit_while_starting)
    )
    if not ours:
        yield
        return
    _pressed = False
    signal.signal(signal.SIGINT, noting)
    terminate = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if terminate:
        signal.signal(signal.SIGTERM, noting)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if terminate:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _pressed = False


def pressed():
    """Whether Ctrl-C was pressed since `watching_ctrl_c` began, even if its KeyboardInterrupt was lost."""
    return _pressed


def raise_if_pressed():
    """Raises KeyboardInterrupt if Ctrl-C was pressed (its own KeyboardInterrupt may have been lost)."""
    if _pressed:
        raise KeyboardInterrupt


def stopped_by_ctrl_c():
    """The command took Ctrl-C as its normal end (a server's stop): it no longer counts as an interrupt."""
    global _pressed
    _pressed = False


@contextlib.contextmanager
def ctrl_c_between_batches():
    """Yields a Keras callback for `fit` that ends training with KeyboardInterrupt at the first batch
    end after a Ctrl-C; inside the block, that first Ctrl-C raises nothing by itself."""
    import keras

    global _deferred
    stop = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs=None: raise_if_pressed(),
        on_test_batch_end=lambda batch, logs=None: raise_if_pressed(),
    )
    _deferred = True
    try:
        yield stop
    finally:
        _deferred = False
    raise_if_pressed()  # pressed during the last batch: the block ends as interrupted


@contextlib.contextmanager
def ctrl_c_stops_a_step():
    """Inside the block the first Ctrl-C raises nothing: it is noted, and the caller, asking `pressed()`
    between its steps (a reply's tokens in `attnkit chat`), stops there; a second one raises at once.
    The note is the caller's to clear (`stopped_by_ctrl_c`) when stopping was all it meant."""
    global _deferred
    _deferred = True
    try:
        yield
    finally:
        _deferred = False
