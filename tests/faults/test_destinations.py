"""Unwritable and special destinations: refused before any training or encoding, nothing touched.

The tests run as root, for whom a chmod-ed directory stays writable; what fails for root as for anyone
is a path under a file, /proc (no file can be created there), or a fault injected into the probe.
"""

import errno
import os
import sys

import numpy as np
import pytest
from fault_helpers import TINY, contents, one_line_error

import attnkit.dates.translator
from attnkit import cli
from attnkit.pipelines import encoder as pretrained

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from pretrained_fixtures import write_tiny_model  # noqa: E402
from backend_utils import once_per_run

pytestmark = once_per_run  # writing, checking and refusing files: the same code whatever the backend

linux_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")


@pytest.fixture
def no_training(monkeypatch):
    monkeypatch.setattr(attnkit.dates.translator, "train_dates", lambda *a, **k: pytest.fail("trained before refusing"))


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bert")
    write_tiny_model(directory)
    return directory


@linux_proc
@pytest.mark.parametrize("directory", ["/proc", "/proc/attnkit-test/model"])
def test_train_into_a_directory_where_nothing_can_be_written(directory, no_training, capsys):
    assert os.access("/proc", os.W_OK)  # the old check (os.access) passed, then the save failed
    assert cli.main(["train", *TINY, "--output-dir", directory]) == 2
    assert one_line_error(capsys).startswith(f"attnkit: error: --output-dir {directory} cannot be written: ")


def test_a_probe_that_cannot_be_written_refuses_before_training(tmp_path, no_training, monkeypatch, capsys):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    target = tmp_path / "a" / "b"
    assert cli.main(["train", *TINY, "--output-dir", str(target)]) == 2
    assert one_line_error(capsys) == f"attnkit: error: --output-dir {target} cannot be written: No space left on device"
    assert os.listdir(tmp_path) == []  # the directories it created are gone again


@pytest.mark.parametrize("name", ["model.keras", "translator.json"])
@pytest.mark.parametrize("kind", ["directory", "symlink", "fifo"])
def test_force_refuses_an_output_that_is_not_a_regular_file(tmp_path, no_training, capsys, name, kind):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere.txt"
    out.mkdir()
    elsewhere.write_text("not yours")
    path = out / name
    if kind == "directory":
        path.mkdir()
        (path / "inside.txt").write_text("keep")
    elif kind == "symlink":
        path.symlink_to(elsewhere)
    else:
        os.mkfifo(path)
    described = {"directory": "a directory", "symlink": "a symbolic link", "fifo": "a special file"}[kind]
    assert cli.main(["train", *TINY, "--output-dir", str(out), "--force"]) == 2
    assert one_line_error(capsys) == (
        f"attnkit: error: --output-dir: {path} is {described}, not a file attnkit wrote; remove it or choose "
        "another directory"
    )
    assert elsewhere.read_text() == "not yours"
    assert kind != "directory" or (path / "inside.txt").read_text() == "keep"


def test_demo_refuses_a_picture_path_that_is_a_directory(tmp_path, no_training, capsys):
    (tmp_path / "cross_attention.png").mkdir()
    assert cli.main(["demo", *TINY, "--output-dir", str(tmp_path), "--force"]) == 2
    assert "cross_attention.png is a directory" in one_line_error(capsys)


def test_library_save_refuses_a_directory_in_place_of_model_keras(tiny_translator, tmp_path):
    (tmp_path / "model.keras").mkdir()
    with pytest.raises(ValueError, match="model.keras is a directory, not a file attnkit wrote"):
        tiny_translator.save(tmp_path, overwrite=True)
    assert os.listdir(tmp_path) == ["model.keras"]


def test_a_failed_training_removes_the_directories_the_check_created(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise MemoryError("out of memory")

    monkeypatch.setattr(attnkit.dates.translator, "train_dates", broken)
    assert cli.main(["train", *TINY, "--output-dir", str(tmp_path / "new" / "dir")]) == 1
    assert one_line_error(capsys) == "attnkit: error: MemoryError: out of memory"
    assert os.listdir(tmp_path) == []


def test_existing_user_files_in_the_output_directory_are_kept(saved_dir, tmp_path, capsys):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(saved_dir, out)
    (out / "notes.txt").write_text("mine")
    assert cli.main(["train", *TINY, "--output-dir", str(out), "--force"]) == 0
    assert sorted(os.listdir(out)) == ["model.keras", "notes.txt", "translator.json"]
    assert (out / "notes.txt").read_text() == "mine"


# embed and heads: the same checks for one output file.

@pytest.fixture
def no_encoding(monkeypatch):
    monkeypatch.setattr(pretrained, "load_pretrained", lambda *a, **k: pytest.fail("loaded before refusing"))


@linux_proc
def test_embed_into_proc_is_refused_before_loading(no_encoding, capsys):
    assert cli.main(["embed", "a", "--output", "/proc/x.npy"]) == 2
    assert one_line_error(capsys).startswith("attnkit: error: --output /proc/x.npy cannot be written: ")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: os.mkfifo(p), "{p} is a special file"),
        (lambda p: p.symlink_to("/dev/full"), "{p} is a symbolic link"),
        (lambda p: p.mkdir(), "{p} is a directory"),
    ],
)
def test_embed_force_refuses_special_outputs(tmp_path, no_encoding, capsys, make, message):
    path = tmp_path / "x.npy"
    make(path)
    assert cli.main(["embed", "a", "--output", str(path), "--force"]) == 2
    assert message.format(p=path) in one_line_error(capsys)


@pytest.mark.parametrize("output", ["{tmp}/missing/x.npy", "{tmp}/file/x.jsonl"])
def test_embed_into_a_missing_directory_is_refused(tmp_path, no_encoding, capsys, output):
    (tmp_path / "file").write_text("")
    output = output.format(tmp=tmp_path)
    assert cli.main(["embed", "a", "--output", output]) == 2
    assert one_line_error(capsys) == f"attnkit: error: --output {output}: no directory {os.path.dirname(output)}"


@pytest.mark.parametrize("error", [KeyboardInterrupt, MemoryError])
def test_an_interrupted_embed_keeps_the_old_output(bert_dir, tmp_path, monkeypatch, capsys, error):
    output = tmp_path / "x.npy"
    np.save(output, np.ones((1, 2)))
    before = contents(tmp_path)

    def interrupted(f, array):
        f.write(b"\x93NUMPY partial")
        raise error()

    monkeypatch.setattr(np, "save", interrupted)
    status = cli.main(["embed", "a", "b", "--model", str(bert_dir), "--output", str(output), "--force"])
    assert status == (130 if error is KeyboardInterrupt else 1)
    assert contents(tmp_path) == before and os.listdir(tmp_path) == ["x.npy"]
