"""How many CPU threads a command of this package runs torch with: the trainer, the evaluation and the Space.

One rule for all three, `choose_threads`, in this order:

1. a count given to the command (`--num_threads N`, or `LMLP_NUM_THREADS=N` for the Space, which takes no flags);
2. a count the user set for the process: `OMP_NUM_THREADS` in the environment the user launched it from, or
   `torch.set_num_threads` called before the command ran in the same Python process;
3. else the command's default: every core this process may run on (`os.sched_getaffinity`), split between the
   processes or requests that share them.

`accelerate launch` sets `OMP_NUM_THREADS=1` for every process it starts unless the user set it (right for several
processes per machine, and on a GPU), which would leave a one-process CPU run on one core. A value that
`accelerate launch` set by itself is therefore not the user's: on Linux the launcher's own environment tells which
(`/proc/<launcher>/environ`); elsewhere only the flag overrides it.

On busy cores, more threads than free cores make every step wait for the slowest thread: with another job on one of 2
cores, 2 threads trained 6× slower than 1 here. When other work is running (`busy_cores_of_others`), the chosen count is
kept (the load may be gone in a minute) but a warning names the flag that sets fewer.
"""

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch


logger = logging.getLogger(__name__)

# The variable that sets the Space's threads (the Space is configured by environment variables, not flags).
THREADS_VARIABLE = "LMLP_NUM_THREADS"


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count a command runs with, and why.

    Args:
        num_threads (`int`): The count.
        reason (`str`): Where it came from, for the log (`"--num_threads"`, `"OMP_NUM_THREADS=1, set by you"`,
            `"every core"`).
    """

    num_threads: int
    reason: str


def available_cores() -> int:
    """The number of cores this process may run on (its CPU affinity, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def launched_by_accelerate() -> bool:
    """Whether `accelerate launch` started this process (it sets these variables for every process it starts)."""
    return "ACCELERATE_DYNAMO_BACKEND" in os.environ and "ACCELERATE_MIXED_PRECISION" in os.environ


def launcher_environment() -> dict[str, str] | None:
    """The environment of the process that started this one, where the system shows it (Linux), else None."""
    try:
        raw = open(f"/proc/{os.getppid()}/environ", "rb").read()
    except OSError:
        return None
    pairs = (entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def user_thread_setting() -> ThreadChoice | None:
    """The thread count the user set for this process (`OMP_NUM_THREADS`, or `torch.set_num_threads` in this Python
    process), or None when the user set none.

    Under `accelerate launch`, `OMP_NUM_THREADS` counts as the user's only when the launcher's own environment had it.
    """
    value = os.environ.get("OMP_NUM_THREADS")
    if value is not None:
        if launched_by_accelerate():
            launcher = launcher_environment()
            if launcher is None or launcher.get("OMP_NUM_THREADS") != value:
                return None  # accelerate's default, not the user's
        try:
            count = int(value)
        except ValueError:
            return None  # torch ignores it too
        if count >= 1:
            return ThreadChoice(count, f"OMP_NUM_THREADS={count}, set by you")
        return None
    if torch.get_num_threads() not in torch_default_counts():
        # Without OMP_NUM_THREADS torch starts with one thread per core: another count was set in this process.
        return ThreadChoice(torch.get_num_threads(), "torch.set_num_threads, called before this command")
    return None


def torch_default_counts() -> set[int]:
    """The thread counts torch may start with when nothing sets one: its physical cores, or every logical core (the
    machine's, or this process's affinity), depending on the build and the machine."""
    import psutil  # a dependency of accelerate

    counts = {available_cores(), os.cpu_count() or 1}
    physical = psutil.cpu_count(logical=False)
    return counts | ({physical} if physical else set())


def choose_threads(num_threads: int | None, default: int | None = None, option: str = "--num_threads") -> ThreadChoice:
    """The thread count for a command, by the rule in the module docstring.

    Args:
        num_threads (`int`, *optional*): The count given to the command (its flag); wins over everything else.
        default (`int`, *optional*): The command's own default; every available core when None.
        option (`str`, *optional*, defaults to `"--num_threads"`): How the user gives the count, for the reason.

    Raises:
        `ValueError`: For a count below 1.
    """
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"{option} must be >= 1, got {num_threads}")
        return ThreadChoice(num_threads, option)
    user = user_thread_setting()
    if user is not None:
        return user
    cores = available_cores()
    count = cores if default is None else max(1, min(default, cores))
    return ThreadChoice(count, "every core" if count == cores else f"{count} of {cores} cores")


def busy_cores_of_others(samples: int = 10, interval: float = 0.02, proc: Path = Path("/proc")) -> float | None:
    """How many cores other processes keep busy right now: the kernel's count of running tasks (`/proc/loadavg`'s
    fourth field) less this process's own running threads, averaged over `samples` reads `interval` seconds apart.

    Not the load average: right after a `pip install` it still counts the install's work on an idle machine.

    Args:
        samples (`int`, *optional*, defaults to 10): Reads to average.
        interval (`float`, *optional*, defaults to 0.02): Seconds between them.
        proc (`Path`, *optional*, defaults to `/proc`): The proc file system.

    Returns:
        `float` or `None`: The mean count; None where `/proc` is missing (not Linux).
    """
    counts = []
    try:
        for sample in range(samples):
            if sample:
                time.sleep(interval)
            running = int((proc / "loadavg").read_text().split()[3].split("/")[0])
            counts.append(running - own_running_threads(proc))
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, sum(counts) / len(counts))


def own_running_threads(proc: Path = Path("/proc")) -> int:
    """The threads of this process that are running or runnable now (state R in `/proc/self/task/*/stat`); the
    reading thread is one of them.

    Args:
        proc (`Path`, *optional*, defaults to `/proc`): The proc file system.
    """
    running = 0
    for stat in (proc / "self" / "task").glob("*/stat"):
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]  # after "pid (comm)", which may hold spaces
        except (OSError, IndexError):
            continue  # a thread that ended while being read
        running += state == "R"
    return max(1, running)


def busy_cores_warning(num_threads: int, option: str = "--num_threads") -> str | None:
    """A warning when other work keeps the cores busy that `num_threads` threads would need, else None.

    Other work is what runs now (`busy_cores_of_others`); where `/proc` is missing, the 1-minute load average.

    Args:
        num_threads (`int`): The chosen count.
        option (`str`, *optional*, defaults to `"--num_threads"`): How the user sets fewer, for the message.
    """
    if num_threads < 2:
        return None
    busy = busy_cores_of_others()
    if busy is None:
        if not hasattr(os, "getloadavg"):
            return None
        busy = os.getloadavg()[0]
    cores = available_cores()
    free = cores - busy
    if free >= num_threads - 0.5:
        return None
    fewer = max(1, int(free + 0.5))
    return (
        f"other work keeps {busy:.1f} of the {cores} cores busy, and {num_threads} threads on busy cores can run "
        f"several times slower than {fewer}. If steps are slow, pass {option} {fewer}."
    )


def apply_threads(choice: ThreadChoice, what: str, option: str = "--num_threads") -> None:
    """Run torch with `choice`'s threads, log it with its reason, and warn when the cores are busy.

    Args:
        choice (`ThreadChoice`): The count and its reason.
        what (`str`): The command, for the log ("training", "evaluation", "the Space").
        option (`str`, *optional*, defaults to `"--num_threads"`): How the user sets the count, for the log.
    """
    torch.set_num_threads(choice.num_threads)
    logger.info(f"{what} on the CPU: {choice.num_threads} thread(s) ({choice.reason}; {option} N to change)")
    warning = busy_cores_warning(choice.num_threads, option)
    if warning:
        logger.warning(warning)
