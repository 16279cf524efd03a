"""Ctrl-C at any moment of a command that writes files ends it with status 130 and leaves the old files
exactly (docs/decisions.md item 112): during the imports (one line, no traceback), while the data or the
model is built, during `fit`, while saving, and during an export."""

import os
import signal
import subprocess
import sys
import time

import pytest

from attnkit import cli
from attnkit.dates import translator as translation

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")
TINY = ["--epochs", "1", "--train-size", "32", "--validation-size", "4", "--batch-size", "16", "--d-model", "16",
        "--heads", "2", "--layers", "1", "--d-ff", "32", "--quiet"]


def _old_model(directory):
    directory.mkdir()
    for name, data in (("model.keras", b"old model"), ("translator.json", b"{}"), ("NOTES.md", b"mine")):
        (directory / name).write_bytes(data)
    return {p: (directory / p).read_bytes() for p in os.listdir(directory)}


def _files(directory):
    return {p: (directory / p).read_bytes() for p in os.listdir(directory)}


def _importing_torch_or_keras(pid):
    """Whether the process has begun loading its backend's libraries (attnkit's first import has run)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    except OSError:
        return False
    return any(lib in maps for lib in ("libtorch", "jaxlib", "_pywrap_tensorflow", "libtensorflow"))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc to time the interrupt")
@pytest.mark.parametrize("command", [["train", *TINY, "--force"], ["export", "--force"]])
def test_ctrl_c_during_the_imports_is_one_line_and_130(tmp_path, command):
    out = tmp_path / "out"
    before = _old_model(out)
    argv = [sys.executable, "-m", "attnkit.cli", *command, *(["--output-dir", str(out)] if command[0] == "train" else [str(out)])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not _importing_torch_or_keras(process.pid) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=300)
    assert (process.returncode, err) == (130, "attnkit: interrupted\n")
    assert _files(out) == before


def _ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)  # the handler runs at the next bytecode: within the sleep


def _interrupting(function):
    def wrapped(*args, **kwargs):
        _ctrl_c()
        return function(*args, **kwargs)

    return wrapped


@pytest.mark.parametrize("moment", ["data", "model", "fit", "saving"])
def test_ctrl_c_while_training_leaves_the_old_model(tmp_path, monkeypatch, capsys, moment):
    out = tmp_path / "out"
    before = _old_model(out)
    if moment == "data":
        monkeypatch.setattr(translation, "make_arrays", _interrupting(translation.make_arrays))
    elif moment == "model":
        monkeypatch.setattr(translation, "build_model", _interrupting(translation.build_model))
    elif moment == "fit":
        monkeypatch.setattr(translation, "make_optimizer", _interrupting(translation.make_optimizer))
    else:
        import attnkit._keras_saving as saving

        monkeypatch.setattr(saving, "no_tensorflow_import", _interrupting(saving.no_tensorflow_import))
    assert cli.main(["train", *TINY, "--force", "--output-dir", str(out)]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "attnkit: interrupted"
    assert _files(out) == before
