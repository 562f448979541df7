"""Durable writes: what is renamed into place was flushed to disk first, so a crash never publishes lost data."""

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
