"""`attnkit finetune --processes N` (decision 133): every process trains on its share of each global
batch, weighted by the whole batch's count of learned tokens, so N processes take the steps one
process takes: the same losses and the same adapter, up to float32 rounding, on every backend's
engine (torch.distributed, jax.distributed, tensorflow's MultiWorkerMirroredStrategy)."""

import json
import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from attnkit.cli import main
from attnkit.finetune import data, finetune, training
from attnkit.pipelines.causal_checkpoint import load_causal_lm
from backend_utils import children
from tiny import date_chats, write_jsonl

ARGS = ["--epochs", "2", "--batch-size", "4", "--learning-rate", "0.05", "--lora-rank", "4", "--lora-alpha", "8", "--max-length", "128"]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_the_shares_hold_every_row_once_and_pad_with_rows_that_learn_nothing(batch, length, world, seed):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, 50, (batch, length)).astype("int32")
    targets = np.where(rng.random((batch, length)) < 0.5, data.IGNORE, inputs).astype("int32")
    shares = [training.share(inputs, targets, rank, world) for rank in range(world)]
    rows = -(-batch // world)
    assert all(i.shape == t.shape == (rows, length) for i, t in shares)
    joined_inputs = np.concatenate([i for i, _ in shares])
    joined_targets = np.concatenate([t for _, t in shares])
    np.testing.assert_array_equal(joined_inputs[:batch], inputs)
    np.testing.assert_array_equal(joined_targets[:batch], targets)
    assert (joined_targets[batch:] == data.IGNORE).all()


def test_token_weights_make_the_loss_the_mean_over_learned_tokens_and_are_required(tiny_dir):
    lm = load_causal_lm(tiny_dir)
    model = training.prepare(lm, rank=2, alpha=4, optimizer=keras.optimizers.SGD(0.0))
    examples = [data.encode(lm, record, 128) for record in date_chats(5, seed=3)]
    inputs, targets = data.collate(examples, lm.pad_id)
    logits = np.asarray(keras.ops.convert_to_numpy(model(inputs)), "float64")  # (B, L, V)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    keep = targets != data.IGNORE
    want = -np.take_along_axis(logp, np.where(keep, targets, 0)[..., None], -1)[..., 0][keep].mean()
    got = float(model.test_on_batch(inputs, targets, sample_weight=training.token_weights(targets), return_dict=True)["loss"])
    assert abs(got - want) < 1e-5
    # Two processes' shares, each weighted by the whole batch's count and scaled by 2: their mean is the whole's.
    count = int(keep.sum())
    halves = [float(model.test_on_batch(i, t, sample_weight=training.token_weights(t, count, 2), return_dict=True)["loss"])
              for i, t in (training.share(inputs, targets, r, 2) for r in range(2))]
    assert abs(np.mean(halves) - want) < 1e-5
    with pytest.raises(ValueError, match="sample_weight"):
        model.test_on_batch(inputs, targets)


def _finetune_command(train, evaluation, tiny_dir, out, *extra):
    return [sys.executable, "-m", "attnkit.cli", "finetune", "--data", train, "--eval", evaluation, "--model", tiny_dir,
            "--output-dir", out, *ARGS, "--processes", "2", *extra]


@pytest.fixture(scope="module")
def runs(tiny_dir, tmp_path_factory):
    """The data and two runs: `one` in this process, `two` with --processes 2."""
    root = tmp_path_factory.mktemp("processes")
    # 13 examples in batches of 4: the last batch has one row, so one process's share is all padding.
    # 5 evaluation examples: the second batch's share of process 1 is padding too.
    train = write_jsonl(root / "train.jsonl", date_chats(13))
    evaluation = write_jsonl(root / "eval.jsonl", date_chats(5, seed=7))
    one, two = str(root / "one"), str(root / "two")
    assert main(["finetune", "--data", train, "--eval", evaluation, "--model", tiny_dir, "--output-dir", one, *ARGS]) == 0
    done = subprocess.run(_finetune_command(train, evaluation, tiny_dir, two), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(root=root, train=train, evaluation=evaluation, one=one, two=two, stdout=done.stdout)


def _history(directory):
    return json.load(open(os.path.join(directory, "finetune.json")))["history"]


def _adapter(directory):
    from safetensors.numpy import load_file

    return load_file(os.path.join(directory, "adapter", "adapter_model.safetensors"))


def _assert_same_run(a, b):
    """Same losses epoch for epoch and the same adapter, up to float32 rounding."""
    for x, y in zip(_history(a), _history(b), strict=True):
        assert abs(x["loss"] - y["loss"]) < 1e-5
        assert abs(x["eval_loss"] - y["eval_loss"]) < 1e-5
    x, y = _adapter(a), _adapter(b)
    assert x.keys() == y.keys()
    for key in x:
        np.testing.assert_allclose(x[key], y[key], atol=1e-5)


def test_two_processes_train_as_one(runs):
    assert "world size 2 (processes); per-process batch 2, global batch 4" in runs["stdout"]
    _assert_same_run(runs["one"], runs["two"])
    assert max(np.abs(v).max() for k, v in _adapter(runs["one"]).items() if "lora_B" in k) > 1e-3  # the adapter did train


def test_a_killed_worker_ends_the_run_with_one_line_and_resume_finishes_it(runs, tiny_dir):
    """SIGKILL of worker 1 after the first checkpoint: the launcher stops the other worker and says
    which one died, in one line; --resume then ends where the uninterrupted run ended."""
    out = str(runs["root"] / "killed")
    command = _finetune_command(runs["train"], runs["evaluation"], tiny_dir, out, "--save-every", "1")
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    progress = os.path.join(out, "checkpoint", "progress.json")
    deadline = time.monotonic() + 600
    while not os.path.exists(progress) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    workers = [pid for pid, line in children(run.pid).items() if "--process-id 1 " in line + " "]
    assert run.poll() is None and len(workers) == 1, "the run ended before its first checkpoint"
    os.kill(workers[0], signal.SIGKILL)
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 1
    assert stderr.strip().splitlines()[-1] == (
        f"attnkit: error: worker 1 of 2 (pid {workers[0]}) was killed by SIGKILL; the other workers were stopped")
    assert children(run.pid) == {}
    assert not os.path.exists(os.path.join(out, "finetune.json"))  # no output of a run that did not end
    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resuming at epoch" in resumed.stdout
    _assert_same_run(out, runs["two"])


@pytest.mark.parametrize("arguments, message", [
    (["--processes", "2", "--batch-size", "3"], "--batch-size must be a multiple of --processes"),
    (["--processes", "2", "--process-id", "0"], "--process-id needs --coordinator"),
    (["--processes", "2", "--coordinator", "10.0.0.1:1234"], "--coordinator must be 127.0.0.1:PORT"),
])
def test_wrong_process_options_are_one_line_before_anything_starts(arguments, message, tiny_dir, tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", date_chats(4))
    assert main(["finetune", "--data", train, "--model", tiny_dir, "--output-dir", str(tmp_path / "out"), *arguments]) == 2
    assert message in capsys.readouterr().err


def test_a_full_output_directory_is_refused_before_workers_start(tiny_dir, tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", date_chats(4))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["finetune", "--data", train, "--model", tiny_dir, "--output-dir", str(out), "--processes", "2"]) != 0
    assert "already holds files" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
