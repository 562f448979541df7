"""Fixtures of the trainer's tests: one tiny workspace per session, and the command run in this process."""

import importlib.util
from types import SimpleNamespace

import pytest
from coco_fixture import CLIP_REPO, SD_REPO, write_coco2014, write_hub_cache
from test_train_text_to_image import ENV, make_workspace

import diffusers_lmlp.train


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """The tiny pipelines and imagefolder of `make_workspace`; each test writes under its own output names."""
    return make_workspace(tmp_path_factory.mktemp("train"))


@pytest.fixture(scope="session")
def script():
    """A fresh copy of the script's command (`diffusers_lmlp.train`), to run in this process."""
    spec = importlib.util.spec_from_file_location("train_text_to_image", diffusers_lmlp.train.__file__)
    spec.loader.exec_module(module := importlib.util.module_from_spec(spec))
    return module


@pytest.fixture(scope="session")
def coco_world(tmp_path_factory) -> SimpleNamespace:
    """A folder holding `coco2014/` (where the COCO commands run), the recipe's component repos and an HF cache."""
    root = tmp_path_factory.mktemp("coco")
    write_coco2014(root / "coco2014")
    env = {**ENV, "HF_HOME": str(root / "hf"), "HF_HUB_CACHE": str(write_hub_cache(root / "hf"))}
    repos = root / "hf" / "repos"
    return SimpleNamespace(root=root, env=env, vae=repos / SD_REPO, text_encoder=repos / CLIP_REPO)
