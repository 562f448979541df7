"""Durable writes, checksums and folder locks: what is renamed into place was flushed to disk first, so a crash never
publishes lost data; a folder's checksums show any byte changed since it was written; a folder one process works in
is locked against a second."""

import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path


def fsync_tree(folder: Path, recursive: bool = True) -> None:
    """Flush `folder` (and with `recursive`, everything in it) to disk; without `recursive`, its renames."""
    for path in [*(folder.rglob("*") if recursive else []), folder]:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def write_durably(path: Path, write: Callable) -> None:
    """Write `path` via `write(binary_file)` under a temporary name, fsync and rename it (the folder is not fsynced)."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def write_json_durably(path: Path, data: dict) -> None:
    """`write_durably` for an indented UTF-8 JSON file, folder entry included."""
    write_durably(path, lambda f: f.write(json.dumps(data, indent=2).encode("utf-8")))
    fsync_tree(path.parent, recursive=False)


def hold_lock(path: Path, wait: bool = False):
    """An exclusive `flock` on `path` (created if need be), held while the returned file stays open and dropped by the
    OS however the process ends; None when another process holds it, unless `wait`, which waits for it."""
    lock = open(path, "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        lock.close()
        return None
    return lock


CHECKSUMS_FILE = "checksums.json"


def write_checksums(folder: Path) -> None:
    """Record the SHA-256 of every file under `folder` in its `checksums.json`."""
    files = sorted(path for path in folder.rglob("*") if path.is_file() and path.name != CHECKSUMS_FILE)
    sums = {}
    for path in files:
        with open(path, "rb") as f:
            sums[path.relative_to(folder).as_posix()] = hashlib.file_digest(f, "sha256").hexdigest()
    (folder / CHECKSUMS_FILE).write_text(json.dumps({"sha256": sums}, indent=1), encoding="utf-8")


def checksum_problem(folder: Path) -> str | None:
    """What differs between `folder` and its `checksums.json` (a file changed, missing or added), or None."""
    try:
        sums = json.loads((folder / CHECKSUMS_FILE).read_text(encoding="utf-8"))["sha256"]
        if not isinstance(sums, dict) or not sums or not all(isinstance(v, str) for v in sums.values()):
            raise ValueError
    except FileNotFoundError:
        return f"it has no {CHECKSUMS_FILE}"
    except (ValueError, KeyError, TypeError):
        return f"its {CHECKSUMS_FILE} is not a list of checksums"
    found = {path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()} - {CHECKSUMS_FILE}
    if missing := sorted(sums.keys() - found):
        return f"{missing[0]} is missing"
    if added := sorted(found - sums.keys()):
        return f"{added[0]} was added after it was written"
    for name in sorted(sums):
        with open(folder / name, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != sums[name]:
                return f"{name} differs from its checksum (damaged or edited)"
    return None
