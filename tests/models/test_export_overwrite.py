"""Overwriting a model directory replaces the model's files only: a user's other files stay, an earlier
model's own files the new one lacks go, and an interrupt at any step leaves the old files exactly
(docs/decisions.md item 111)."""

import os

import numpy as np
import pytest
from checkpoint_fixtures import TEXTS

import attnkit
from attnkit import _atomic_save, cli

pytest.importorskip("transformers")

USER_FILES = {"NOTES.md": b"my notes\n", "README.md": b"# my model card\n", "eval_results/scores.json": b"{\"acc\": 1}",
              "1_Pooling/my_plot.png": b"\x89PNG...", "train.log": b"epoch 1\n"}


def _snapshot(directory):
    """{relative path: bytes} of every file under `directory`, hidden staging files included."""
    found = {}
    for folder, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, directory)] = f.read()
    return found


@pytest.fixture(scope="module")
def encoders(checkpoints):
    """An old model with a Dense and a Normalize module, and a new one with neither."""
    old = attnkit.load_pretrained(checkpoints.sentence("bert", "cls", dense="Tanh", normalize=True))
    new = attnkit.load_pretrained(checkpoints.sentence("bert", "mean"))
    return old, new


@pytest.fixture
def model_dir(encoders, tmp_path):
    """The old model saved, with the user's files beside it and an earlier sharded save's leftovers."""
    target = tmp_path / "model"
    encoders[0].save_pretrained(target)
    for name, data in {**USER_FILES, "model-00001-of-00002.safetensors": b"old shard",
                       "model.safetensors.index.json": b"{}"}.items():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes(data)
    return target


def test_an_overwrite_keeps_the_users_files_and_drops_the_old_models(encoders, model_dir):
    old, new = encoders
    assert (model_dir / "2_Dense" / "model.safetensors").exists()
    new.save_pretrained(model_dir, overwrite=True)
    after = _snapshot(model_dir)
    assert {k: after.get(k) for k in USER_FILES} == USER_FILES  # byte for byte
    # The old model's Dense, Normalize and shards would be read with the new one: gone.
    assert not (model_dir / "2_Dense").exists() and not (model_dir / "3_Normalize").exists()
    assert "model-00001-of-00002.safetensors" not in after and "model.safetensors.index.json" not in after
    assert not [k for k in after if k.startswith(".attnkit-")]
    np.testing.assert_allclose(attnkit.load_pretrained(str(model_dir)).encode(TEXTS[:3]), new.encode(TEXTS[:3]), atol=1e-6)


def test_a_module_folder_holding_the_users_file_stays_with_that_file(encoders, model_dir):
    (model_dir / "2_Dense" / "notes.txt").write_text("why tanh")
    encoders[1].save_pretrained(model_dir, overwrite=True)
    assert os.listdir(model_dir / "2_Dense") == ["notes.txt"]


@pytest.mark.parametrize("failing_call", [0, 1, 5, 9, 12])
def test_an_overwrite_interrupted_at_any_rename_leaves_the_old_files_exactly(encoders, model_dir, monkeypatch, failing_call):
    before = _snapshot(model_dir)
    calls, real = [], os.replace

    def replace(src, dst):
        if len(calls) == failing_call and ".attnkit-old-" not in str(src):  # the rollback's own renames pass
            calls.append(dst)
            raise KeyboardInterrupt
        calls.append(dst)
        return real(src, dst)

    monkeypatch.setattr(_atomic_save.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        encoders[1].save_pretrained(model_dir, overwrite=True)
    assert _snapshot(model_dir) == before


def test_an_overwrite_interrupted_while_writing_leaves_the_old_files_exactly(encoders, model_dir, monkeypatch):
    from attnkit.checkpoints import export

    before = _snapshot(model_dir)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "_write_modules", interrupted)
    with pytest.raises(KeyboardInterrupt):
        encoders[1].save_pretrained(model_dir, overwrite=True)
    assert _snapshot(model_dir) == before


def test_the_export_command_with_force_keeps_the_users_files(checkpoints, model_dir, capsys):
    assert cli.main(["export", str(model_dir), "--model", checkpoints.sentence("bert", "mean"), "--force"]) == 0
    after = _snapshot(model_dir)
    assert {k: after.get(k) for k in USER_FILES} == USER_FILES


def test_a_symbolic_link_on_the_way_is_refused_before_anything_is_written(encoders, model_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (model_dir / "1_Pooling" / "config.json").unlink()
    (model_dir / "1_Pooling" / "my_plot.png").unlink()
    (model_dir / "1_Pooling").rmdir()
    (model_dir / "1_Pooling").symlink_to(elsewhere)
    before = _snapshot(model_dir)
    with pytest.raises(ValueError, match=r"1_Pooling is a symbolic link; attnkit writes 1_Pooling/config.json only"):
        encoders[1].save_pretrained(model_dir, overwrite=True)
    assert _snapshot(model_dir) == before and os.listdir(elsewhere) == []
