"""Opt-in CPU allocator setting that lets eager inference run near the GEMM peak.

PyTorch's CPU allocator hands large buffers to glibc, which serves them with fresh `mmap`s and returns them to
the system when they are freed. Every forward pass then pays a page fault per 4 KiB of every new activation: on
two cores that costs the eager F2-deep forward about a tenth of its time (benchmarks/speed_vs_uvit.py,
`--reuse_freed_memory`). Asking glibc to keep freed memory for reuse removes that cost. It changes the whole
process's allocator, so it is never done on import; applications (a sampling server, a benchmark) call it.
"""

import ctypes
import ctypes.util


_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3
_MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's ceiling on 64-bit systems


def reuse_freed_memory(keep_bytes: int = 1024**3) -> bool:
    """Make glibc serve buffers up to 32 MiB from its heap and keep up to `keep_bytes` of freed memory for reuse.

    The same as starting Python with `MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=<keep_bytes>`. A
    process that calls it holds on to up to `keep_bytes` it no longer uses.

    Args:
        keep_bytes (`int`, *optional*, defaults to 1 GiB): Freed memory glibc keeps instead of returning it.

    Returns:
        `bool`: `True` when glibc accepted the settings, `False` where there is no glibc (macOS, Windows, musl).
    """
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, TypeError, AttributeError):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, keep_bytes)) and bool(mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD))
