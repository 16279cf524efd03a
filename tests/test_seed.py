"""`attnkit._seed.set_random_seed`: keras.utils.set_random_seed's seeds, without importing tensorflow
under another backend (docs/decisions.md item 87)."""

import os
import random
import subprocess
import sys

import keras
import numpy as np

from attnkit._seed import set_random_seed
from backend_utils import BACKEND, once_per_run


def draws():
    out = [random.random(), float(np.random.rand()), np.asarray(keras.ops.convert_to_numpy(keras.random.normal((4,))))]
    if BACKEND == "torch":
        import torch

        out.append(torch.rand(3).numpy())
    return out


def test_same_draws_as_keras_set_random_seed():
    set_random_seed(1234)
    ours = draws()
    keras.utils.set_random_seed(1234)
    theirs = draws()
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)
    set_random_seed(99)
    assert random.random() != ours[0]


@once_per_run
def test_tensorflow_not_imported_under_torch_or_jax():
    code = ("import sys; from attnkit._seed import set_random_seed; set_random_seed(0); "
            "from keras.src.utils import rng_utils; print('tensorflow' in sys.modules, rng_utils.tf._available)")
    for backend in ("torch", "jax"):
        env = {**os.environ, "KERAS_BACKEND": backend}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["False", "None"], (backend, result.stdout)
