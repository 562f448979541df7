"""Fixtures of the trainer's tests: one tiny workspace per session, and the command run in this process."""

import pytest
from test_train_text_to_image import load_script, make_workspace


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """The tiny pipelines and imagefolder of `make_workspace`; each test writes under its own output names."""
    return make_workspace(tmp_path_factory.mktemp("train"))


@pytest.fixture(scope="session")
def script():
    return load_script()
