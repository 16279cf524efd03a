"""The fault-injection suite: the CLI and the saved files under unwritable and special destinations,
interrupts during saves, truncated and mismatched files, and empty and huge inputs.

One tiny date translator (trained for two steps: its outputs are garbage, which is what the flagging
tests want) is trained once per session and saved once; tests copy the saved directory.
"""

import shutil

import pytest


@pytest.fixture(scope="session")
def tiny_translator():
    from attnkit.dates.translator import TrainConfig, train_dates

    config = TrainConfig(epochs=1, n_train=64, n_validation=8, batch_size=32, d_model=16, h=2, d_ff=32, n=1)
    return train_dates(config, verbose=0)[0]


@pytest.fixture(scope="session")
def saved_dir(tiny_translator, tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved") / "model"
    tiny_translator.save(directory)
    return directory


@pytest.fixture
def model_copy(saved_dir, tmp_path):
    """A fresh copy of the saved directory, to damage."""
    copy = tmp_path / "model"
    shutil.copytree(saved_dir, copy)
    return copy
