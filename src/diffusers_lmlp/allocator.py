"""glibc's allocator setting that lets CPU work run near the GEMM peak (glibc returns freed large buffers to the
system, so every pass page-faults each new activation back in). Never done on import; your own setting is kept."""

import ctypes
import ctypes.util
import logging
import os


logger = logging.getLogger(__name__)


_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3
_MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's ceiling on 64-bit systems
MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def reuse_freed_memory(keep_bytes: int = 1024**3) -> bool:
    """Make glibc serve buffers up to 32 MiB from its heap and keep up to `keep_bytes` of freed memory for reuse, as
    `MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=<keep_bytes>` do; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, TypeError, AttributeError):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, keep_bytes)) and bool(mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD))


def keep_freed_memory(device) -> None:
    """On a CPU `device`, `reuse_freed_memory` unless you set glibc's malloc yourself; the log says which."""
    if device.type != "cpu":
        return
    setting = next((name for name in MALLOC_VARIABLES if name in os.environ), None)
    if setting is None and "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        setting = "GLIBC_TUNABLES"
    if setting is not None:
        logger.info(f"CPU memory: glibc's malloc as your {setting} sets it")
    elif reuse_freed_memory():
        logger.info(
            "CPU memory: glibc keeps up to 1 GiB of freed buffers for reuse, so that each pass does not page-fault "
            "them back in (set MALLOC_TRIM_THRESHOLD_ to choose otherwise)"
        )
    else:
        logger.info("CPU memory: no glibc here (macOS, Windows, musl), the allocator is unchanged")
