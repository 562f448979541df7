"""The glibc allocator setting: applied where glibc exists, a no-op elsewhere, on the CPU unless the user set malloc's."""

import ctypes
import logging
import platform

import pytest
import torch

from diffusers_lmlp import allocator


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="needs glibc")
def test_reuse_freed_memory_is_accepted_by_glibc(monkeypatch):
    calls = []
    real_cdll = ctypes.CDLL

    class RecordingLibc:
        def __init__(self, name):
            self._libc = real_cdll(name)

        def mallopt(self, param, value):
            calls.append((param, value))
            return self._libc.mallopt(param, value)

    monkeypatch.setattr(allocator.ctypes, "CDLL", RecordingLibc)
    assert allocator.reuse_freed_memory(keep_bytes=512 * 1024**2) is True
    assert calls == [(-1, 512 * 1024**2), (-3, 32 * 1024**2)]  # M_TRIM_THRESHOLD, then M_MMAP_THRESHOLD


def no_libc(name):
    raise OSError(f"{name}: cannot open shared object file")


@pytest.mark.parametrize("libc", [no_libc, lambda name: object()], ids=["no-libc", "no-mallopt"])
def test_reuse_freed_memory_without_glibc_returns_false(monkeypatch, libc):
    monkeypatch.setattr(allocator.ctypes, "CDLL", libc)
    assert allocator.reuse_freed_memory() is False


@pytest.fixture
def recorded(monkeypatch) -> list[str]:
    """`reuse_freed_memory` replaced by a recorder, with no malloc setting in the environment."""
    calls = []
    for name in (*allocator.MALLOC_VARIABLES, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator, "reuse_freed_memory", lambda: calls.append("reuse") or True)
    return calls


@pytest.mark.parametrize(
    "name, value, reused, logged",
    [
        (None, None, True, "glibc keeps up to 1 GiB of freed buffers for reuse"),
        ("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F", True, "glibc keeps up to 1 GiB"),  # not malloc's
        ("MALLOC_TRIM_THRESHOLD_", "0", False, "glibc's malloc as your MALLOC_TRIM_THRESHOLD_ sets it"),
        ("MALLOC_MMAP_THRESHOLD_", "131072", False, "glibc's malloc as your MALLOC_MMAP_THRESHOLD_ sets it"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0", False, "glibc's malloc as your GLIBC_TUNABLES sets it"),
    ],
)
def test_on_the_cpu_freed_memory_is_kept_unless_you_set_glibcs_malloc(
    recorded, monkeypatch, caplog, name, value, reused, logged
):
    if name:
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.INFO, logger="diffusers_lmlp.allocator"):
        allocator.keep_freed_memory(torch.device("cpu"))
        allocator.keep_freed_memory(torch.device("meta"))  # a GPU run, as far as this is concerned: nothing changes
    assert recorded == (["reuse"] if reused else []) and logged in caplog.text


def test_without_glibc_the_log_says_the_allocator_is_unchanged(recorded, monkeypatch, caplog):
    monkeypatch.setattr(allocator, "reuse_freed_memory", lambda: False)
    with caplog.at_level(logging.INFO, logger="diffusers_lmlp.allocator"):
        allocator.keep_freed_memory(torch.device("cpu"))
    assert "no glibc here" in caplog.text
