"""How many CPU threads the trainer and the evaluation run torch with: `--num_threads N`, else the `OMP_NUM_THREADS`
you set (`accelerate launch` sets it in every process: it counts when the launcher's own environment has it), else
every core this process may run on."""

import logging
import os

import torch


logger = logging.getLogger(__name__)


def available_cores() -> int:
    """The number of cores this process may run on (its CPU affinity, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def launcher_environment() -> dict[str, str]:
    """The environment the parent process (the launcher) was started with; empty where the system does not show it."""
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(entry.decode(errors="replace").split("=", 1) for entry in entries if b"=" in entry)


def set_threads(num_threads: int | None, what: str, one_cpu_process: bool = True) -> None:
    """Run torch with `num_threads`, else the user's `OMP_NUM_THREADS`, else every core, and log which (as `what`).
    Unless `one_cpu_process` (the run's only process, on the CPU), only `num_threads` changes the launcher's."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    launched = "ACCELERATE_DYNAMO_BACKEND" in os.environ  # set by `accelerate launch` in every process it starts
    if num_threads is not None:
        reason = "--num_threads"
    elif not one_cpu_process:
        return
    elif omp.isdigit() and int(omp) >= 1 and (not launched or launcher_environment().get("OMP_NUM_THREADS") == omp):
        num_threads, reason = int(omp), "OMP_NUM_THREADS"
    else:
        num_threads, reason = available_cores(), "every core"
    torch.set_num_threads(num_threads)
    logger.info(f"{what} on the CPU: {num_threads} thread(s) ({reason}; --num_threads N to change)")
