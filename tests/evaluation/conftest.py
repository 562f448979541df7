"""Fixtures shared by the evaluation and analysis tests."""

import pytest
import torch


@pytest.fixture
def no_unpickling(monkeypatch):
    """Every load must read safetensors only: `torch.load` (pickle) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("loading unpickled a file with torch.load")

    monkeypatch.setattr(torch, "load", refuse)


@pytest.fixture(scope="module")
def one_thread():
    """Models this small run fastest on one CPU thread, and much faster than on two on a busy machine."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture
def torch_threads():
    """Restore torch's thread count, which the commands set."""
    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)
