"""Data-parallel training (`attnkit.distributed`, `train_dates(data_parallel=True)`, `--data-parallel`).

The two-device runs happen in subprocesses (tests/distributed_worker.py), because the device count must be
set before a backend starts: jax through XLA_FLAGS, tensorflow through logical CPU devices. Each pass runs
one of them, of another backend than its own (`WORKER_BACKEND`), so the three passes cover both engines
and the model they save is loaded here, in this plain one-device process of another backend.
"""

import json
import logging
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

from attnkit.cli import main
from attnkit.distributed import DataParallelPlan, data_parallel_plan
from attnkit.dates.translator import DateTranslator, TrainConfig, train_dates
from backend_utils import XLA_FAST_COMPILE

WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")
TORCH_MESSAGE = r"supported on the jax and tensorflow backends, not on torch\. .*KERAS_BACKEND=jax"
# Both runs add up the same float32 numbers in a different order: on two devices each half-batch's loss
# and gradients are summed on its device and the halves are then all-reduced. One float32 rounding is
# 6e-8 relative; over 8 Adam steps on a loss of ~4 the gap measured is 0 (jax) to 7e-8 (tensorflow), so
# 1e-4 leaves three orders of magnitude of headroom and still fails on any real difference (a global batch
# of 32 instead of 16, i.e. 4 steps instead of 8, moves the epoch loss by ~2%).
LOSS_RTOL = 1e-4
# The worker each pass runs: both engines over the three passes, each saved model loaded by another
# backend (a worker run takes 30-40 s; running both in every pass cost three minutes a CI run).
WORKER_BACKEND = {"torch": "jax", "jax": "tensorflow", "tensorflow": "jax"}[keras.backend.backend()]


def _environment(backend):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    if backend == "jax":
        env["JAX_PLATFORMS"] = "cpu"  # two CPU devices even where jax also sees a GPU
        # Two CPU devices; and less XLA optimisation, which halves the compile time (the same flags in
        # both runs, so the comparison holds).
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=2 {XLA_FAST_COMPILE}"
    return env


@pytest.fixture(scope="module", params=[WORKER_BACKEND])
def two_devices(request, tmp_path_factory):
    """(backend, output directory, result.json) of one worker run on two CPU devices."""
    backend = request.param
    pytest.importorskip(backend)
    out = tmp_path_factory.mktemp(f"data_parallel_{backend}")
    run = subprocess.run(
        [sys.executable, WORKER, backend, str(out)], env=_environment(backend), capture_output=True, text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    with open(out / "result.json") as f:
        return backend, out, json.load(f)


def test_data_parallel_loss_matches_one_device(two_devices):
    _, _, result = two_devices
    assert len(result["devices"]) == 2
    for key in ("loss", "val_loss"):  # mean loss over the 8 steps; loss of the final weights
        np.testing.assert_allclose(result["data_parallel"][key], result["single"][key], rtol=LOSS_RTOL)


def test_data_parallel_log_names_the_engine_and_the_devices(two_devices):
    backend, _, result = two_devices
    engine = {"jax": "keras.distribution.DataParallel (jax)", "tensorflow": "tf.distribute.MirroredStrategy"}[backend]
    assert result["log"] == [f"engine: {engine}; 2 devices: {', '.join(result['devices'])}; global batch 16, 8 per device"]
    if backend == "jax":  # XLA's rendezvous abort (exit 134) is pushed past the step watchdog
        assert result["xla_flags_in_time"] is True
        assert "--xla_cpu_collective_call_terminate_timeout_seconds=86400" in result["xla_flags"]


def test_step_watchdog_turns_a_stuck_step_into_one_line():
    code = (
        "import time; from attnkit.distributed.watchdog import StepWatchdog; "
        "w = StepWatchdog('worker 3 of 4', 1, 2); w.on_train_begin(); w.on_train_batch_end(0); time.sleep(30)"
    )
    run = subprocess.run([sys.executable, "-c", code], env=_environment("torch"), capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    (line,) = run.stderr.strip().splitlines()
    assert re.fullmatch(r"attnkit: error: worker 3 of 4: no training step finished in [12] s: a collective is stuck "
                        r"\(another process died or cannot be reached, or the machine is overloaded\)", line)


def test_xla_collective_time_outs_are_raised_and_the_users_flags_kept(monkeypatch):
    from attnkit.distributed import local

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2 --xla_cpu_collective_timeout_seconds=5")
    if not local.relax_xla_collective_timeouts():
        pytest.skip("jax has started in this process: the flags can only be checked in a fresh one (the worker does)")
    flags = os.environ["XLA_FLAGS"].split()
    assert flags[:2] == ["--xla_force_host_platform_device_count=2", "--xla_cpu_collective_timeout_seconds=5"]
    assert "--xla_cpu_collective_call_terminate_timeout_seconds=86400" in flags
    assert not any(f.startswith("--xla_cpu_collective_timeout_seconds=86400") for f in flags)


def test_each_device_holds_half_of_the_batch(two_devices):
    _, _, result = two_devices
    devices = [device for device, _ in result["split"]]
    assert len(set(devices)) == 2
    assert [shape for _, shape in result["split"]] == [[8, 32], [8, 32]]  # global batch 16, S = 32
    assert result["variable_devices"] == [2]  # every trained weight lives on both devices


def test_data_parallel_model_loads_and_translates_on_one_device(two_devices):
    _, out, result = two_devices
    translator = DateTranslator.load(str(out / "model"))
    translations, (decoded,) = translator.translate(result["texts"], return_attention_weights=True)
    assert translations == result["translations"]
    # Same weights, one device instead of two (and maybe another backend): float32 rounding only.
    np.testing.assert_allclose(decoded.step_logits, np.load(out / "step_logits.npy"), rtol=1e-4, atol=1e-5)


def test_torch_has_no_data_parallel_engine():
    with pytest.raises(ValueError, match=TORCH_MESSAGE):
        data_parallel_plan(backend="torch")


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="train_dates on the torch backend")
def test_train_dates_data_parallel_on_torch_raises():
    with pytest.raises(ValueError, match=TORCH_MESSAGE):
        train_dates(TrainConfig(epochs=1, n_train=16, n_validation=16), verbose=0, data_parallel=True)


def test_cli_data_parallel_on_torch_is_one_line(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "attnkit.cli", "train", "--data-parallel", "--quiet", "--output-dir", str(tmp_path)],
        env=_environment("torch"), capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnkit: error: Data-parallel training is supported on the jax")
    assert os.listdir(tmp_path) == []


def test_cli_accepts_data_parallel_on_train_and_demo(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--data-parallel" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "--data-parallel" in capsys.readouterr().out


def test_batch_size_must_split_over_the_devices():
    plan = DataParallelPlan(None, ["cpu:0", "cpu:1"])
    assert plan.local_batch_size(16) == 16
    with pytest.raises(ValueError, match=r"multiple of the number of devices \(2: cpu:0, cpu:1\)\. Received: batch_size=15"):
        plan.local_batch_size(15)


def test_each_process_feeds_its_share():
    # 2 hosts x 2 devices: a global batch of 16 is 8 per host; 10 examples -> 8 (whole device splits),
    # host 1 keeps the odd ones.
    plan = DataParallelPlan(None, ["a", "b", "c", "d"], process_index=1, process_count=2)
    assert plan.local_batch_size(16) == 8
    (ids,) = plan.local_examples(np.arange(10))
    np.testing.assert_array_equal(ids, [1, 3, 5, 7])
    with pytest.raises(ValueError, match="needs at least 4 examples in `examples`. Received: examples=3"):
        plan.local_examples(np.arange(3))
    with pytest.raises(ValueError, match="needs at least 4 examples in `n_validation`. Received: n_validation=3"):
        plan.local_examples(np.arange(3), name="n_validation")


def test_jax_plan_does_not_shard_the_slices_again():
    """Each host feeds its own slice: Keras's auto-sharding, which refuses arrays on several hosts,
    stays off (a two-process run failed at its first `fit` with it on)."""
    if keras.backend.backend() != "jax":
        pytest.skip("keras.distribution's DataParallel is the jax engine")
    from attnkit.distributed import data_parallel_plan

    assert data_parallel_plan().engine.auto_shard_dataset is False


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="jax keys its compiled programs on the mesh in an argument's type")
def test_a_data_parallel_run_compiles_its_train_step_once(caplog):
    """On one device Keras keeps the first weights and each epoch's reset metrics off the mesh, the
    step's outputs are on it: without `commit_state` the step compiled three times in two epochs."""
    import jax

    config = TrainConfig(epochs=2, n_train=64, n_validation=8, batch_size=16, d_model=16, h=2, n=1, d_ff=32, rate=0.0)
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        _, _, history = train_dates(config, verbose=0, data_parallel=True)
    compiled = [r.getMessage() for r in caplog.records if "Finished XLA compilation of jit(train_step)" in r.getMessage()]
    assert len(compiled) == 1, compiled
    assert len(history.history["loss"]) == 2 and history.history["loss"][1] < history.history["loss"][0]
