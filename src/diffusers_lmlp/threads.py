"""How many CPU threads the trainer and the evaluation run torch with.

`--num_threads N` wins; else the `OMP_NUM_THREADS` you set; else every core this process may run on. `accelerate
launch` sets `OMP_NUM_THREADS` in every process it starts (1 unless told otherwise), which is right for several
processes or a GPU, so those keep it; a one-process CPU run under it takes every core unless `--num_threads` is given.
"""

import logging
import os

import torch


logger = logging.getLogger(__name__)


def available_cores() -> int:
    """The number of cores this process may run on (its CPU affinity, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_threads(num_threads: int | None, what: str, one_cpu_process: bool = True) -> None:
    """Run torch with `--num_threads`, else the user's `OMP_NUM_THREADS`, else every core, and log which.

    Args:
        num_threads (`int`, *optional*): `--num_threads`; wins over everything else.
        what (`str`): The command, for the log ("training", "evaluation").
        one_cpu_process (`bool`, *optional*, defaults to `True`): Whether this is the run's only process and runs on
            the CPU; otherwise the launcher's setting stays unless `num_threads` is given.
    """
    omp = os.environ.get("OMP_NUM_THREADS", "")
    launched = "ACCELERATE_DYNAMO_BACKEND" in os.environ  # set by `accelerate launch` in every process it starts
    if num_threads is not None:
        reason = "--num_threads"
    elif not one_cpu_process:
        return
    elif omp.isdigit() and int(omp) >= 1 and not launched:
        num_threads, reason = int(omp), "OMP_NUM_THREADS"
    else:
        num_threads, reason = available_cores(), "every core"
    torch.set_num_threads(num_threads)
    logger.info(f"{what} on the CPU: {num_threads} thread(s) ({reason}; --num_threads N to change)")
