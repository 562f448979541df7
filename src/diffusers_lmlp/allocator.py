"""glibc's allocator setting that lets CPU work run near the GEMM peak: the trainer and the evaluation command apply it
on the CPU, and a sampling loop or a server can.

PyTorch's CPU allocator hands large buffers to glibc, which serves them with fresh `mmap`s, or from a heap it trims,
and returns them to the system when they are freed. Every pass then pays a page fault per 4 KiB of every new
activation: on two cores that costs the eager F2-deep forward about a tenth of its time (benchmarks/speed_vs_uvit.py,
`--reuse_freed_memory`), and the README's main command in float32, as `accelerate launch` starts it, up to a quarter
of every step in the runs that fall into it (5,000-20,000 faults a step; docs/benchmarks.md), and the evaluation
command about a seventh of its time (docs/evaluation.md). Asking glibc to keep freed memory for reuse removes that
cost. It changes the whole process's allocator, so it is never done on import: the trainer and the evaluation command
do it for work on the CPU (`keep_freed_memory`), other applications call `reuse_freed_memory`. Where you set glibc's
malloc yourself (`MALLOC_TRIM_THRESHOLD_`, `MALLOC_MMAP_THRESHOLD_`, `GLIBC_TUNABLES=glibc.malloc.*`), they keep your
setting.
"""

import ctypes
import ctypes.util
import logging
import os


logger = logging.getLogger(__name__)


_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3
_MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's ceiling on 64-bit systems
# The environment variables through which a user sets glibc's malloc thresholds for a process.
MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


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


def malloc_set_by_user() -> str | None:
    """The environment setting through which you chose glibc's malloc thresholds for this process, or None.

    Returns:
        `str`, *optional*: `"MALLOC_TRIM_THRESHOLD_"`, `"MALLOC_MMAP_THRESHOLD_"` or `"GLIBC_TUNABLES"` (when it sets
        a `glibc.malloc` tunable).
    """
    for name in MALLOC_VARIABLES:
        if name in os.environ:
            return name
    return "GLIBC_TUNABLES" if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") else None


def keep_freed_memory(device) -> None:
    """For work on the CPU, `reuse_freed_memory`, unless you set glibc's malloc yourself (`malloc_set_by_user`); the
    log says which.

    Args:
        device (`torch.device`): Where the work runs; on another device (a GPU) nothing changes.
    """
    if device.type != "cpu":
        return
    setting = malloc_set_by_user()
    if setting is not None:
        logger.info(f"CPU memory: glibc's malloc as your {setting} sets it")
    elif reuse_freed_memory():
        logger.info(
            "CPU memory: glibc keeps up to 1 GiB of freed buffers for reuse, so that each pass does not page-fault "
            "them back in (set MALLOC_TRIM_THRESHOLD_ to choose otherwise)"
        )
    else:
        logger.info("CPU memory: no glibc here (macOS, Windows, musl), the allocator is unchanged")
