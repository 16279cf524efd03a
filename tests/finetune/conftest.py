import pytest
import os, sys
sys.path.insert(0, os.path.dirname(__file__))


from tiny import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random llama directory saved by transformers (see tiny.py)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
