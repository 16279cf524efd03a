"""Helpers of the server tests: the tiny models' writers (tests/explorer, tests/models) and the solo reference."""

import importlib.util
import os
import sys

_here = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(_here, "..", "models"))
from pretrained_fixtures import write_tiny_model  # noqa: E402,F401

# tests/explorer/conftest.py's writer, loaded under its own name (every conftest module is "conftest").
_spec = importlib.util.spec_from_file_location("explorer_fixtures", os.path.join(_here, "..", "explorer", "conftest.py"))
_explorer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_explorer)
write_tiny_llama = _explorer.write_tiny_llama


def solo(lm, ids, max_tokens, **options):
    """The request served alone by the library: `PretrainedCausalLM.generate_ids` of one prompt."""
    return lm.generate_ids([ids], max_new_tokens=max_tokens, **options)[0]
