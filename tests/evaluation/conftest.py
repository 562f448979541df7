"""Fixtures shared by the evaluation and analysis tests."""

import pytest
import torch
from coco_fixture import write_clip_repo
from space_server import one_cpu_thread

from diffusers_lmlp.evaluation.clip_score import CLIPScorer


@pytest.fixture
def no_unpickling(monkeypatch):
    """Every load must read safetensors only: `torch.load` (pickle) fails the test."""
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: pytest.fail("loading unpickled a file with torch.load"))


@pytest.fixture(scope="module")
def one_thread():
    with one_cpu_thread():
        yield


@pytest.fixture
def torch_threads():
    """Restore torch's thread count, which the commands set."""
    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="session")
def clip_folder(tmp_path_factory):
    """A tiny CLIP in `openai/clip-vit-large-patch14`'s layout."""
    return write_clip_repo(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="session")
def clip_scorer(clip_folder) -> CLIPScorer:
    return CLIPScorer.from_pretrained(clip_folder)
