"""Choose the default Keras backend before Keras is imported (docs/decisions.md item 3).

Order of precedence:
1. `KERAS_BACKEND` in the environment (the user's explicit choice);
2. a `"backend"` entry in `$KERAS_HOME/keras.json` (default `~/.keras/keras.json`), unless that
   file is exactly the one Keras writes by itself on its first import (backend "tensorflow" and the
   other three defaults): Keras writes it before it reads `KERAS_BACKEND`, so it says nothing
   about what the user chose;
3. otherwise the first installed of torch, jax, tensorflow (torch trains fastest on the CPU boxes).

If Keras was already imported, its backend is fixed and this module changes nothing. A name Keras
has no backend for is refused here, naming where it came from, rather than by Keras's import; the
`attnkit` command prints that as its one line and exits with status 2.
"""

import importlib.util
import json
import os
import sys

PREFERENCE = ("torch", "jax", "tensorflow")
KERAS_BACKENDS = PREFERENCE + ("numpy", "openvino")  # what keras.config.backend() may be
KERAS_WRITTEN_DEFAULT = {
    "floatx": "float32",
    "epsilon": 1e-07,
    "backend": "tensorflow",
    "image_data_format": "channels_last",
}


def _keras_home():
    return os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")


def _keras_json_backend():
    try:
        with open(os.path.join(_keras_home(), "keras.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config == KERAS_WRITTEN_DEFAULT:
        return None
    return config.get("backend")


def choose_backend():
    """Returns the backend name attnkit will ask Keras for, without importing Keras.

    Raises ValueError for a name Keras has no backend for."""
    if os.environ.get("KERAS_BACKEND"):
        return _known(os.environ["KERAS_BACKEND"], "KERAS_BACKEND")
    configured = _keras_json_backend()
    if configured:
        return _known(configured, "the \"backend\" of " + os.path.join(_keras_home(), "keras.json"))
    for name in PREFERENCE:
        if importlib.util.find_spec(name) is not None:
            return name
    return "tensorflow"  # Keras's own default; its import error then names what is missing.


def _known(name, source):
    if name not in KERAS_BACKENDS:
        raise ValueError(f"{source}: expected one of {', '.join(KERAS_BACKENDS)}, got {name!r}")
    return name


def _running_the_command():
    """Whether this process is the `attnkit` command (its console script, or `python -m attnkit.cli`)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    return os.path.basename(sys.argv[0]) == "attnkit" or any(
        flag == "-m" and module.startswith("attnkit") for flag, module in zip(argv, argv[1:]))


if _running_the_command():
    from attnkit._interrupts import exit_on_ctrl_c_while_starting

    exit_on_ctrl_c_while_starting()  # Ctrl-C during the imports: one line, status 130 (docs/decisions.md item 112)

if "keras" not in sys.modules:
    try:
        os.environ["KERAS_BACKEND"] = choose_backend()
    except ValueError as e:
        if not _running_the_command():
            raise
        print(f"attnkit: error: {e}", file=sys.stderr)  # the command's one line (attnkit.cli), before it can import
        raise SystemExit(2) from None
