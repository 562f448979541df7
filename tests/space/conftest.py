"""The shipped shapes pipeline the Space tests share (read-only): as loaded, and frozen by the app's `main`."""

import contextlib
import io
from types import SimpleNamespace

import pytest
import torch
from space_server import load_app, one_cpu_thread, shapes_pipeline


@pytest.fixture(scope="session")
def shapes_pipe():
    with one_cpu_thread():
        yield shapes_pipeline()


@pytest.fixture(scope="session")
def frozen_app() -> SimpleNamespace:
    """The pipeline and output of the app's `main` run in-process, unlaunched, frozen, on one thread in float32."""
    app, pipe, output = load_app(), shapes_pipeline(), io.StringIO()
    num_threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(output):
        for name in ("OMP_NUM_THREADS", "LMLP_CONCURRENCY", "LMLP_QUEUE_SIZE"):
            patch.delenv(name, raising=False)
        for name, value in {"LMLP_NUM_THREADS": "1", "LMLP_FREEZE": "1", "LMLP_MODEL": "shapes"}.items():
            patch.setenv(name, value)
        patch.setattr(app, "pick_device_and_dtype", lambda: ("cpu", torch.float32))
        patch.setattr(app, "load_pipeline", lambda model, dtype: pipe)
        launched = []
        patch.setattr(app, "launch", launched.append)
        app.main()
    torch.set_num_threads(num_threads)
    assert len(launched) == 1
    return SimpleNamespace(pipe=pipe, output=output.getvalue())
