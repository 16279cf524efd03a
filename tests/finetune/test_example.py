"""examples/finetune_dates.py runs end to end (scaled down, on the tiny model)."""

import importlib.util
import os

import pytest
from backend_utils import once_per_run

pytest.importorskip("transformers")
pytestmark = once_per_run  # the loop itself is tested on every backend in test_finetune_cli.py


def test_scaled_down_date_example_runs(tiny_dir, tmp_path):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "finetune_dates.py")
    spec = importlib.util.spec_from_file_location("finetune_dates", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    train, held_out = example.split(20, 5, seed=0)
    assert not {s for s, _ in train} & {s for s, _ in held_out}  # held out: never trained on
    result = example.run(n_train=4, n_eval=3, batch_size=4, rank=2, alpha=4, model=tiny_dir, max_length=256,
                         output_dir=str(tmp_path / "out"), log=lambda *a: None)
    assert 0 <= result["before"] <= 1 and 0 <= result["after"] <= 1 and result["train_seconds"] > 0
    assert len(result["history"]) == 1 and os.path.isfile(tmp_path / "out" / "adapter" / "adapter_config.json")
