"""Durable writes: what is renamed into place was flushed to disk first, so a crash never publishes lost data."""

import os
from pathlib import Path


def fsync_tree(folder: Path, recursive: bool = True) -> None:
    """Flush a folder (and with `recursive`, everything in it) to disk, so that a rename never publishes lost data.

    Without `recursive`, this makes the renames in `folder` durable.

    Args:
        folder (`Path`): The folder.
        recursive (`bool`, *optional*, defaults to `True`): Also flush the files and folders inside it.
    """
    for path in [*(folder.rglob("*") if recursive else []), folder]:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
