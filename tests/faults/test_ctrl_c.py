"""Ctrl-C during a command: never lost, never reported as an error, never half a save
(docs/decisions.md item 57). These send real SIGINTs to this process through the handlers."""

import gc
import os
import signal
import time
import types

import keras
import numpy as np
import pytest
from fault_helpers import one_line_error

from attnkit import cli
from attnkit._interrupts import ctrl_c_between_batches, watching_ctrl_c


def _command(monkeypatch, run):
    """Makes `cli.main` run `run(args)` as the command, whatever the arguments."""
    parser = types.SimpleNamespace(parse_args=lambda argv: types.SimpleNamespace(run=run))
    monkeypatch.setattr(cli, "build_parser", lambda: parser)


def _ctrl_c():
    """A real Ctrl-C, through the installed handlers; returns when its KeyboardInterrupt is raised."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
    raise AssertionError("SIGINT raised nothing")


def test_an_error_raised_while_ctrl_c_unwinds_is_reported_as_the_interrupt(monkeypatch, capsys):
    """Code that Ctrl-C cuts short can raise its own error in place of the KeyboardInterrupt
    (tensorflow's device scope, NumPy's retry of `__array__`); that is still the interrupt."""

    def run(args):
        try:
            _ctrl_c()
        finally:
            raise RuntimeError("Exiting device scope without proper scope nesting")

    _command(monkeypatch, run)
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err == "attnkit: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back as it was


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost interrupt
def test_a_sigterm_unwinds_as_an_interrupt_so_that_saves_clean_up(monkeypatch, capsys, tmp_path):
    """`kill` (SIGTERM) ended the process at once and left a save's staging files behind; while a
    command runs it now raises KeyboardInterrupt, as Ctrl-C does, and the `finally` blocks run."""
    cleaned = []

    def run(args):
        staging = tmp_path / ".staging"
        staging.mkdir()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            raise AssertionError("SIGTERM raised nothing")
        finally:
            staging.rmdir()
            cleaned.append(True)

    _command(monkeypatch, run)
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err == "attnkit: interrupted\n"
    assert cleaned and not (tmp_path / ".staging").exists()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # put back as it was


def test_a_ctrl_c_swallowed_by_a_gc_callback_still_stops_the_save(tmp_path, monkeypatch, capsys):
    """A KeyboardInterrupt raised in a garbage-collector callback is printed and lost by Python; the
    save after it must not replace the user's file, and the command ends as interrupted."""
    from attnkit._atomic_save import replace_files

    (tmp_path / "model.keras").write_bytes(b"old")

    def run(args):
        _lose_a_ctrl_c()
        replace_files(str(tmp_path), {"model.keras": lambda path: open(path, "wb").write(b"new")})
        return 0

    _command(monkeypatch, run)
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "attnkit: interrupted"
    assert sorted(os.listdir(tmp_path)) == ["model.keras"] and (tmp_path / "model.keras").read_bytes() == b"old"
    # After the command, a library save in the same process is not refused for that Ctrl-C.
    replace_files(str(tmp_path), {"model.keras": lambda path: open(path, "wb").write(b"later")})
    assert (tmp_path / "model.keras").read_bytes() == b"later"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost interrupt
def test_a_ctrl_c_swallowed_before_an_explorer_export_keeps_the_old_page(tmp_path, monkeypatch):
    from attnkit.explorer import export

    page = tmp_path / "page.html"
    page.write_text("the user's old page")
    monkeypatch.setattr(export, "render_page", lambda description, data: "<!DOCTYPE html>the new page")
    source = types.SimpleNamespace(attention=lambda text, decimals: _lose_a_ctrl_c(), describe=lambda: {})
    with watching_ctrl_c(), pytest.raises(KeyboardInterrupt):
        export.export_page(str(page), source, "the cat", force=True)
    assert page.read_text() == "the user's old page" and os.listdir(tmp_path) == ["page.html"]


def _lose_a_ctrl_c():
    """A Ctrl-C whose KeyboardInterrupt Python swallows in a garbage-collector callback: the code goes on."""

    def collecting(phase, info):
        _ctrl_c()

    gc.callbacks.append(collecting)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(collecting)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost interrupt
def test_a_ctrl_c_swallowed_after_the_last_save_still_ends_as_interrupted(monkeypatch, capsys):
    def run(args):
        _lose_a_ctrl_c()
        return 0

    _command(monkeypatch, run)
    assert cli.main(["train"]) == 130


def test_an_error_chained_to_another_error_is_still_an_error(monkeypatch, capsys):
    def run(args):
        try:
            raise ValueError("bad --steps")
        except ValueError as e:
            raise RuntimeError("wrapped") from e

    _command(monkeypatch, run)
    assert cli.main(["train"]) == 1
    assert one_line_error(capsys) == "attnkit: error: RuntimeError: wrapped"


def test_inside_fit_the_first_ctrl_c_stops_training_at_the_batch_end():
    """Raised at a batch end, between the framework's steps, not inside its dataset code."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    ends = []

    def press_at_batch_2(batch, logs=None):
        ends.append(batch)
        if batch == 2:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)  # the signal is handled here: it must raise nothing by itself

    with watching_ctrl_c(), pytest.raises(KeyboardInterrupt):
        with ctrl_c_between_batches() as stop:
            model.fit(
                np.zeros((64, 3)), np.zeros((64, 1)), batch_size=4, epochs=3, verbose=0,
                callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=press_at_batch_2), stop],
            )
    assert ends == [0, 1, 2]  # training ended at the end of batch 2


def test_inside_fit_a_second_ctrl_c_raises_at_once():
    with watching_ctrl_c(), pytest.raises(KeyboardInterrupt), ctrl_c_between_batches():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # the first: noted only
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        raise AssertionError("the second Ctrl-C raised nothing")
