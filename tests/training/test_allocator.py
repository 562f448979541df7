"""glibc's allocator setting: applied where glibc exists, a no-op elsewhere, on the CPU unless you set malloc's."""

import ctypes.util
import logging
import platform
from unittest.mock import Mock, call

import pytest
import torch

from diffusers_lmlp import allocator


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="needs glibc")
def test_reuse_freed_memory_is_accepted_by_glibc(monkeypatch):
    libc = Mock(wraps=ctypes.CDLL(ctypes.util.find_library("c")))  # glibc's own, recording the calls
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: libc)
    assert allocator.reuse_freed_memory(keep_bytes=512 * 1024**2) is True
    assert libc.mallopt.call_args_list == [call(-1, 512 * 1024**2), call(-3, 32 * 1024**2)]  # M_TRIM, M_MMAP_THRESHOLD


@pytest.mark.parametrize(
    "libc", [Mock(side_effect=OSError("no libc")), lambda name: object()], ids=["none", "no-mallopt"]
)
def test_reuse_freed_memory_without_glibc_returns_false(monkeypatch, libc):
    monkeypatch.setattr(allocator.ctypes, "CDLL", libc)
    assert allocator.reuse_freed_memory() is False


@pytest.mark.parametrize(
    "name, value, reused, logged",
    [
        (None, None, True, "glibc keeps up to 1 GiB of freed buffers for reuse"),
        ("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F", True, "glibc keeps up to 1 GiB"),  # not malloc's
        *[(name, value, False, f"glibc's malloc as your {name} sets it") for name, value in [
            ("MALLOC_TRIM_THRESHOLD_", "0"), ("MALLOC_MMAP_THRESHOLD_", "131072"),
            ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")]],
        ("no glibc", None, True, "no glibc here"),  # reuse_freed_memory tried, and returned False
    ],
)  # fmt: skip
def test_on_the_cpu_freed_memory_is_kept_unless_you_set_glibc_malloc(monkeypatch, caplog, name, value, reused, logged):
    for variable in (*allocator.MALLOC_VARIABLES, "GLIBC_TUNABLES"):
        monkeypatch.delenv(variable, raising=False)
    if value:
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(allocator, "reuse_freed_memory", reuse := Mock(return_value=name != "no glibc"))
    with caplog.at_level(logging.INFO, logger="diffusers_lmlp.allocator"):
        allocator.keep_freed_memory(torch.device("cpu"))
        allocator.keep_freed_memory(torch.device("meta"))  # a GPU run, as far as this is concerned: nothing changes
    assert reuse.call_count == reused and logged in caplog.text  # once, or never
