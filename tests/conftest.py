"""Shared test setup: every test runs offline (no Hub access), on tiny randomly initialised components."""

import os


# Read by huggingface_hub at import, so it is set before anything imports it: a test that tries to download fails.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402


# The plain-torch re-statements shared by the block tests assert there: let pytest explain their failures.
pytest.register_assert_rewrite("plain_torch")

import torch  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

from diffusers_lmlp import LMLPPipeline  # noqa: E402
from diffusers_lmlp.tiny import build_tiny_pipeline  # noqa: E402


# Under pytest-xdist (one worker per core) each worker, and every command a test starts, uses its share of the cores
# (`THREAD_SHARE`; None under `-n 0` or a user's OMP_NUM_THREADS): a command on every core would fight the workers.
THREAD_SHARE = None
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # not on macOS
    THREAD_SHARE = max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(THREAD_SHARE)
    os.environ["OMP_NUM_THREADS"] = str(THREAD_SHARE)


def pytest_configure(config):
    config.thread_share = THREAD_SHARE  # read by tests/project/test_readme.py


@pytest.fixture(autouse=True)
def fresh_accelerate():
    """No accelerate state before or after a test: it is process-wide (another mixed precision would be refused)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def make_pipe():
    """Build fresh tiny pipelines (16×16 images, 16 text tokens), progress bar off, on one CPU thread (faster)."""

    def make(backbone: str = "lmlp", seed: int = 0) -> LMLPPipeline:
        pipe = build_tiny_pipeline(backbone, seed=seed)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield make
    torch.set_num_threads(num_threads)


@pytest.fixture
def pipe(make_pipe) -> LMLPPipeline:
    return make_pipe()


@pytest.fixture
def generate():
    """Run a pipeline with 2 steps, a seeded CPU generator and `output_type="pt"` unless overridden."""

    def run(pipe: LMLPPipeline, seed: int = 0, **kwargs):
        kwargs = {"prompt": "a red circle", "num_inference_steps": 2, "output_type": "pt", **kwargs}
        return pipe(generator=torch.Generator().manual_seed(seed), **kwargs).images

    return run
