"""The examples run: the seeds' listings print the seeds' output shape; the classifier learns its task."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

import keras

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


@pytest.mark.parametrize("script", ["seed_000_multi_head_attention.py", "seed_002_encoder.py"])
def test_seed_listing_prints_the_seed_output_shape(script):
    env = {**os.environ, "KERAS_BACKEND": keras.backend.backend()}
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^output shape: \(64, 5, 512\)$", result.stdout, re.MULTILINE), result.stdout


def load_classifier_example():
    spec = importlib.util.spec_from_file_location("encoder_classifier", os.path.join(EXAMPLES, "encoder_classifier.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_labels_depend_only_on_the_order_of_a_and_b():
    example = load_classifier_example()
    ids, labels = example.make_data(500, 10, 16, seed=0)
    for row, label in zip(ids, labels):
        assert (row == example.A).sum() == (row == example.B).sum() == 1
        assert label == (list(row).index(example.A) < list(row).index(example.B))
    assert 0.35 < labels.mean() < 0.65


def test_scaled_down_classifier_learns_the_order_task():
    example = load_classifier_example()
    result = example.train(n_train=1500, n_val=500, sequence_length=8, n=1, epochs=3)
    assert result["val_accuracy"] > 0.9, result  # chance is 0.5; no bag of tokens can beat it


def test_minilm_fine_tunes_exports_and_reloads_in_sentence_transformers(tmp_path):
    pytest.importorskip("sentence_transformers")
    # In a process of its own: it trains with the backend while sentence-transformers loads torch, and
    # after a thousand tests in one tensorflow process that mix once ended in a segmentation fault.
    program = (
        "import importlib.util, json, sys\n"
        "spec = importlib.util.spec_from_file_location('finetune_minilm', sys.argv[1])\n"
        "example = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(example)\n"
        "result = example.run(sys.argv[2], epochs=1, learning_rate=1e-4, train_layers=1)\n"
        "print('RESULT ' + json.dumps({k: float(v) for k, v in result.items()}))\n"
    )
    env = {**os.environ, "KERAS_BACKEND": keras.backend.backend()}
    completed = subprocess.run(
        [sys.executable, "-c", program, os.path.join(EXAMPLES, "finetune_minilm.py"), str(tmp_path / "model")],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["weight_change"] > 1e-4  # fit trained the encoder's own layers
    assert result["accuracy_after"] >= max(result["accuracy_before"], 0.9), result
    assert result["export_difference"] <= 1e-5, result
