"""The opt-in glibc allocator setting: applied where glibc exists, a clean no-op elsewhere."""

import ctypes
import platform

import pytest

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


def test_reuse_freed_memory_without_glibc_returns_false(monkeypatch):
    def no_libc(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(allocator.ctypes, "CDLL", no_libc)
    assert allocator.reuse_freed_memory() is False

    class MuslLike:  # a libc without mallopt
        def __init__(self, name):
            pass

    monkeypatch.setattr(allocator.ctypes, "CDLL", MuslLike)
    assert allocator.reuse_freed_memory() is False
