"""Choose the default Keras backend before Keras is imported (docs/decisions.md item 3).

Order of precedence:
1. `KERAS_BACKEND` in the environment (the user's explicit choice);
2. a `"backend"` entry in `$KERAS_HOME/keras.json` (default `~/.keras/keras.json`), unless that
   file is exactly the one Keras writes by itself on its first import (backend "tensorflow" and the
   other three defaults): Keras writes it before it reads `KERAS_BACKEND`, so it says nothing
   about what the user chose;
3. otherwise the first installed of torch, jax, tensorflow (torch trains fastest on the CPU boxes).

If Keras was already imported, its backend is fixed and this module changes nothing.
"""

import importlib.util
import json
import os
import sys

PREFERENCE = ("torch", "jax", "tensorflow")
KERAS_WRITTEN_DEFAULT = {
    "floatx": "float32",
    "epsilon": 1e-07,
    "backend": "tensorflow",
    "image_data_format": "channels_last",
}


def _keras_json_backend():
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config == KERAS_WRITTEN_DEFAULT:
        return None
    return config.get("backend")


def choose_backend():
    """Returns the backend name attnkit will ask Keras for, without importing Keras."""
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"]
    configured = _keras_json_backend()
    if configured:
        return configured
    for name in PREFERENCE:
        if importlib.util.find_spec(name) is not None:
            return name
    return "tensorflow"  # Keras's own default; its import error then names what is missing.


if "keras" not in sys.modules:
    os.environ["KERAS_BACKEND"] = choose_backend()
