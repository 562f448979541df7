"""How a run's output folder names its checkpoints: what the argument checks read before anything heavy is imported,
and what `training.checkpoints` writes."""

import re
from pathlib import Path


# A checkpoint is only ever complete under this name. The other names are those of an operation under way (see
# `save_checkpoint` and `remove_checkpoint`), which a killed run leaves behind and the next one cleans up:
#   .checkpoint-N.tmp       being written                       → removed
#   .checkpoint-N.old       set aside while checkpoint-N is     → removed, or renamed back when checkpoint-N is missing
#                           replaced
#   .checkpoint-N.deleting  being deleted                       → removed
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
UNDER_WAY_PATTERN = re.compile(r"^\.checkpoint-(\d+)\.(tmp|old|deleting)$")
# The run's own state inside a checkpoint, next to accelerate's: {"step": ..., "train_seconds": ...}.
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
    """Complete checkpoints, oldest first. A checkpoint is written under a temporary name and renamed when complete,
    so an interrupted write (`.checkpoint-N.tmp`) never appears here."""
    found = [p for p in output_dir.glob("checkpoint-*") if p.is_dir() and CHECKPOINT_PATTERN.match(p.name)]
    return sorted(found, key=checkpoint_step)
