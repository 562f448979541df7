"""Fixtures shared by the pipeline tests."""

import pytest
import torch


@pytest.fixture
def no_unpickling(monkeypatch):
    """`torch.load` (pickle) fails the test: loading must read safetensors only."""
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: pytest.fail("loading unpickled a file with torch.load"))


@pytest.fixture
def record_batches():
    """`record_batches(*modules)`: the list of the batch sizes of every forward call of `modules`, in order."""

    def record(*modules: torch.nn.Module) -> list[int]:
        batch_sizes = []
        for module in modules:
            module.register_forward_pre_hook(lambda _, args: batch_sizes.append(args[0].shape[0]))
        return batch_sizes

    return record
