import pytest
from checkpoint_fixtures import Checkpoints


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Every family's random checkpoints, built once per test session on first use."""
    return Checkpoints(tmp_path_factory.mktemp("checkpoints"))
