"""How a run's output folder names its checkpoints: light enough for the argument checks, and what
`training.checkpoints` writes."""

import re
from pathlib import Path


# A checkpoint is only ever complete under this name. A killed run may leave an operation under way, which the next
# one cleans up: `.checkpoint-N.tmp` (being written) and `.checkpoint-N.deleting` are removed; `.checkpoint-N.old`
# (set aside while checkpoint-N is replaced) is removed, or renamed back when checkpoint-N is missing.
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
UNDER_WAY_PATTERN = re.compile(r"^\.checkpoint-(\d+)\.(tmp|old|deleting)$")
# The run's own state inside a checkpoint: {"step": ..., "train_seconds": ...}.
STATE_FILE = "training_state.json"
# Held (flock) by the main process of the run that uses the output folder.
LOCK_FILE = ".train.lock"


def checkpoint_step(path: Path) -> int:
    """The step of a `checkpoint-N` folder.

    Args:
        path (`Path`): The checkpoint folder.
    """
    return int(CHECKPOINT_PATTERN.match(path.name).group(1))


def list_checkpoints(output_dir: Path) -> list[Path]:
    """The complete checkpoints, oldest first (an interrupted write, `.checkpoint-N.tmp`, never appears here).

    Args:
        output_dir (`Path`): The `--output_dir`.
    """
    found = [p for p in output_dir.glob("checkpoint-*") if p.is_dir() and CHECKPOINT_PATTERN.match(p.name)]
    return sorted(found, key=checkpoint_step)
