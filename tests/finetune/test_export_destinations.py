"""Where `finetune` and `export` write: an --output-dir that is a file is refused before training, an
export into the base model's own directory is refused (it would overwrite the base and make the
adapter's base the merged model), and a full fine-tune exported over an earlier LoRA export leaves no
adapter of the other run beside it. Weights that diverge end the run rather than be written."""

import os
import shutil

import pytest

pytest.importorskip("transformers")

from attnkit.finetune import export, finetune  # noqa: E402
from tiny import date_chats, write_jsonl  # noqa: E402

SETTINGS = dict(epochs=1, batch_size=4, lora_rank=2, max_length=128, log=lambda *a: None)


def test_an_output_dir_that_is_a_file_is_refused_before_training(tiny_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", date_chats(2))
    user = tmp_path / "notes.txt"
    user.write_text("mine")
    steps = []
    with pytest.raises(FileExistsError, match="exists and is not a directory"):
        finetune(train, str(user), model=tiny_dir, on_step=steps.append, **SETTINGS)
    assert steps == [] and user.read_text() == "mine"


def test_an_output_dir_that_cannot_be_created_is_refused_before_training(tiny_dir, tmp_path):
    """It was found at the first checkpoint: an epoch's training lost to a bare '[Errno 20] Not a directory'."""
    train = write_jsonl(tmp_path / "train.jsonl", date_chats(2))
    steps = []
    with pytest.raises(ValueError, match=r"--output-dir .*train.jsonl/out cannot be created \(Not a directory\)"):
        finetune(train, str(tmp_path / "train.jsonl" / "out"), model=tiny_dir, on_step=steps.append, **SETTINGS)
    assert steps == []


def test_export_refuses_the_base_directory_and_drops_a_stale_adapter(tiny_dir, tmp_path):
    base = str(tmp_path / "base")
    shutil.copytree(tiny_dir, base)
    train = write_jsonl(tmp_path / "train.jsonl", date_chats(4))
    lora, full = str(tmp_path / "lora"), str(tmp_path / "full")
    finetune(train, lora, model=base, **SETTINGS)
    finetune(train, full, model=base, full=True, **SETTINGS)
    before = open(os.path.join(base, "model.safetensors"), "rb").read()
    with pytest.raises(FileExistsError, match="already exists; pass --force"):
        export(lora, base)
    with pytest.raises(FileExistsError, match="is the base model"):
        export(lora, base, force=True)
    assert open(os.path.join(base, "model.safetensors"), "rb").read() == before and not os.path.isdir(os.path.join(base, "adapter"))
    out = str(tmp_path / "out")
    export(lora, out)
    assert os.path.isdir(os.path.join(out, "adapter"))
    with pytest.raises(FileExistsError, match="already exists; pass --force"):  # another model of the user's, perhaps
        export(full, out)
    export(full, out, force=True)  # the LoRA run's adapter beside the full run's weights would be another run's update
    assert not os.path.exists(os.path.join(out, "adapter"))
    user = tmp_path / "notes.txt"
    user.write_text("mine")
    for force in (False, True):  # before, --force said only "[Errno 17] File exists"
        with pytest.raises(FileExistsError, match="exists and is not a directory"):
            export(lora, str(user), force=force)
    assert user.read_text() == "mine"


def test_weights_that_diverge_end_the_run_instead_of_writing_a_nan_model(tiny_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", date_chats(8))
    out = tmp_path / "out"
    # AdamW steps each weight by ~ the rate: the two steps' losses are finite (torch: the second may
    # not be), LoRA's A and B of ~1e30 too, their product in the merged kernels is not
    with pytest.raises(FloatingPointError, match="(not finite at|the loss became nan at) .*; lower --learning-rate"):
        finetune(train, str(out), model=tiny_dir, learning_rate=1e30, **SETTINGS)
    assert not os.path.exists(out / "model.safetensors") and not os.path.exists(out / "checkpoint")


def test_a_run_stopped_before_its_outputs_resumes_to_write_them(tiny_dir, tmp_path):
    """Killed after the last checkpoint but before finetune.json (written last): --resume trains no
    more and writes the outputs the uninterrupted run wrote; a finished run is asked for more epochs."""
    train = write_jsonl(tmp_path / "train.jsonl", date_chats(4))
    out = tmp_path / "out"
    finetune(train, str(out), model=tiny_dir, **SETTINGS)
    written = {name: (out / name).read_bytes() for name in ("model.safetensors", "finetune.json")}
    with pytest.raises(ValueError, match="has already trained 1 epochs; ask for more with --epochs"):
        finetune(train, str(out), model=tiny_dir, resume=True, **SETTINGS)
    for name in written:
        os.remove(out / name)
    steps = []
    finetune(train, str(out), model=tiny_dir, resume=True, on_step=steps.append, **SETTINGS)
    assert steps == [] and {name: (out / name).read_bytes() for name in written} == written
