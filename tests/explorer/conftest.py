"""Models for the explorer tests: tiny ones written at test time, the embedded MiniLM, and Chromium."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from pretrained_fixtures import write_tiny_model  # noqa: E402

# Two batches of training: the model barely learns, and decodes every step up to its limit (11)
# rather than emitting its end token at once, so the tests see many decoding steps.
TINY_TRANSLATOR = dict(epochs=1, n_train=128, n_validation=32, batch_size=64, d_model=32, h=2, n=2, d_ff=64)


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory):
    """A 2-layer, 2-head random BERT that reads at most 16 tokens."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="session")
def translator_dir(tmp_path_factory):
    """A date translator trained for seconds (2 layers, 2 heads) and saved as `attnkit train` saves it."""
    from attnkit.translation import TrainConfig, train_dates

    translator, _, _ = train_dates(TrainConfig(**TINY_TRANSLATOR), verbose=0)
    directory = tmp_path_factory.mktemp("translator")
    translator.save(str(directory))
    return str(directory)


@pytest.fixture(scope="session")
def translator_source(translator_dir):
    from attnkit.explorer import open_model

    return open_model(translator_dir)


@pytest.fixture(scope="session")
def minilm_source():
    from attnkit.explorer import open_model

    return open_model()


@pytest.fixture(scope="session")
def tiny_source(tiny_bert_dir):
    from attnkit.explorer import open_model

    return open_model(tiny_bert_dir)
