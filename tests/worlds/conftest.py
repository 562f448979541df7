"""Fixtures shared by the world tests."""

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def script(request):
    """`scripts/<SCRIPT>.py`, `SCRIPT` being the test module's (or the test's indirect parameter)."""
    return load_benchmark(getattr(request, "param", request.module.SCRIPT), "scripts")
