"""Durable writes and folder locks: what is renamed into place was flushed to disk first, so a crash never publishes
lost data; a folder one process works in is locked against a second."""

import fcntl
import os
from pathlib import Path


def fsync_tree(folder: Path, recursive: bool = True) -> None:
    """Flush `folder` (and with `recursive`, everything in it) to disk; without `recursive`, its renames."""
    for path in [*(folder.rglob("*") if recursive else []), folder]:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def hold_lock(path: Path):
    """An exclusive `flock` on `path` (created if need be), held while the returned file stays open and dropped by the
    OS however the process ends; None when another process holds it."""
    lock = open(path, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock
