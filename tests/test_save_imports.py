"""Saving a model on torch or jax does not import tensorflow (docs/decisions.md item 114)."""

import os
import subprocess
import sys

import keras
import pytest

SCRIPT = r"""
import sys
from attnkit.dates.translator import DateTranslator, TrainConfig, train_dates
translator, _, _ = train_dates(TrainConfig(epochs=1, n_train=32, n_validation=4, batch_size=32, d_model=16, h=2, n=1,
                                           d_ff=32), verbose=0)
translator.save(sys.argv[1])
DateTranslator.load(sys.argv[1]).translate(["March 3, 2021"])
print("tensorflow" in sys.modules)
"""


@pytest.mark.skipif(keras.backend.backend() == "tensorflow", reason="tensorflow is the backend itself")
def test_a_save_does_not_import_tensorflow(tmp_path):
    pytest.importorskip("tensorflow")  # the anchor: only an installed tensorflow could be imported
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env = dict(os.environ, KERAS_BACKEND=keras.backend.backend(),
               PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "model")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False"
    assert "absl" not in run.stderr
