"""The default Keras backend (docs/decisions.md founding decision F2, item 2): `KERAS_BACKEND`, then a user's keras.json, then
the first installed of torch, jax, tensorflow. The file Keras writes by itself does not count."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from attnkit import _backend
from backend_utils import once_per_run

REAL_FIND_SPEC = importlib.util.find_spec


@pytest.fixture
def keras_home(tmp_path, monkeypatch):
    """An empty KERAS_HOME and no KERAS_BACKEND."""
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    return tmp_path


def installed_only(monkeypatch, *names):
    """Makes `choose_backend` see only `names` among the backends."""

    def find_spec(name, *args, **kwargs):
        if name in _backend.PREFERENCE and name not in names:
            return None
        return REAL_FIND_SPEC(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def write_keras_json(home, **config):
    (home / "keras.json").write_text(json.dumps(config, indent=4))


@pytest.mark.parametrize("name", ["jax", "tensorflow", "torch"])
def test_keras_backend_variable_wins(keras_home, monkeypatch, name):
    write_keras_json(keras_home, backend="numpy", floatx="float16")
    monkeypatch.setenv("KERAS_BACKEND", name)
    assert _backend.choose_backend() == name


def test_user_keras_json_is_honoured(keras_home):
    write_keras_json(keras_home, floatx="float32", epsilon=1e-07, backend="jax", image_data_format="channels_last")
    assert _backend.choose_backend() == "jax"


def test_user_keras_json_choosing_tensorflow_is_honoured(keras_home):
    # Backend "tensorflow" like Keras's own file, but the user changed another entry: theirs.
    write_keras_json(keras_home, floatx="float32", epsilon=1e-07, backend="tensorflow", image_data_format="channels_first")
    assert _backend.choose_backend() == "tensorflow"


def test_empty_keras_backend_variable_is_ignored(keras_home, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "")
    write_keras_json(keras_home, backend="jax")
    assert _backend.choose_backend() == "jax"


def test_file_keras_writes_by_itself_is_ignored(keras_home):
    write_keras_json(keras_home, **_backend.KERAS_WRITTEN_DEFAULT)
    assert _backend.choose_backend() == "torch"


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"floatx": "float32"}'], ids=["bad-json", "list", "no-backend"])
def test_unusable_keras_json_falls_through(keras_home, content):
    (keras_home / "keras.json").write_text(content)
    assert _backend.choose_backend() == "torch"


@pytest.mark.parametrize(
    "installed, expected",
    [(("torch", "jax", "tensorflow"), "torch"), (("jax", "tensorflow"), "jax"), (("tensorflow",), "tensorflow"),
     (("tensorflow", "torch"), "torch"), ((), "tensorflow")],
    ids=["all", "no-torch", "tensorflow-only", "torch-and-tensorflow", "none"],
)
def test_first_installed_in_preference_order(keras_home, monkeypatch, installed, expected):
    installed_only(monkeypatch, *installed)
    assert _backend.choose_backend() == expected


@once_per_run
def test_import_picks_torch_and_ignores_the_file_keras_then_writes(keras_home):
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env["KERAS_HOME"] = str(keras_home)
    result = subprocess.run(
        [sys.executable, "-c", "import attnkit, keras; print(keras.backend.backend())"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "torch"
    # Keras wrote its own keras.json on that first import; the next choice must not take it as the user's.
    written = json.loads((keras_home / "keras.json").read_text())
    assert written["backend"] == "tensorflow"
    assert _backend.choose_backend() == "torch"


def test_unknown_keras_backend_variable_is_refused_naming_it(keras_home, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "pytorch")
    with pytest.raises(ValueError, match=r"KERAS_BACKEND: expected one of torch, jax, tensorflow.*got 'pytorch'"):
        _backend.choose_backend()


def test_unknown_keras_json_backend_is_refused_naming_the_file(keras_home):
    write_keras_json(keras_home, backend="theano")
    with pytest.raises(ValueError, match=r"keras\.json: expected one of torch.*got 'theano'"):
        _backend.choose_backend()


@once_per_run
@pytest.mark.parametrize("how", [["-m", "attnkit.cli"], ["-c", "import attnkit"]], ids=["command", "library"])
def test_unknown_backend_at_import(keras_home, how):
    """The command prints its one line and exits 2 (it fails before `attnkit.cli.main` can run);
    a library import raises the ValueError."""
    env = {**os.environ, "KERAS_HOME": str(keras_home), "KERAS_BACKEND": "bogus"}
    result = subprocess.run([sys.executable, *how, "--help"], env=env, capture_output=True, text=True, timeout=300)
    if how[0] == "-m":
        assert (result.returncode, result.stdout) == (2, "")
        assert result.stderr == ("attnkit: error: KERAS_BACKEND: expected one of torch, jax, tensorflow, numpy, "
                                 "openvino, got 'bogus'\n")
    else:
        assert result.returncode == 1
        assert result.stderr.strip().splitlines()[-1].startswith("ValueError: KERAS_BACKEND: expected one of")
