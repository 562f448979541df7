"""Running a command whose processes may hang (a multi-process launch), without hanging the test suite, and reading
what it warned about."""

import re
import signal
import subprocess

import psutil


def run_bounded(argv: list[str], *, env: dict, timeout: float, cwd=None) -> subprocess.CompletedProcess:
    """Run `argv`; when it outlives `timeout`, dump the Python stacks of it and all its descendants, kill them all and
    fail with the stderr (stacks included), so that a hang is diagnosable and leaves no process spinning.

    Args:
        argv (`list[str]`): The command.
        env (`dict`): Its environment (`PYTHONFAULTHANDLER=1` is added: SIGABRT then prints every thread's stack).
        timeout (`float`): Seconds before it counts as hung.
        cwd (*optional*): Its working directory.

    Raises:
        `AssertionError`: When it hung, with the tail of its stderr.
    """
    process = subprocess.Popen(
        argv,
        env={**env, "PYTHONFAULTHANDLER": "1"},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        for member in tree:
            with_gone_ignored(member.send_signal, signal.SIGABRT)
        _, alive = psutil.wait_procs(tree, timeout=10)
        for member in alive:
            with_gone_ignored(member.kill)
        stdout, stderr = process.communicate()
        raise AssertionError(f"{argv[:6]} … hung for {timeout} s; the stacks of its processes:\n{stderr[-12000:]}")
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def with_gone_ignored(action, *args) -> None:
    """Signal a process that may have ended meanwhile.

    Args:
        action: A bound `psutil.Process` method.
        *args: Its arguments.
    """
    try:
        action(*args)
    except psutil.NoSuchProcess:
        pass


def warnings_in(log: str) -> list[str]:
    """The warning lines of a command's output: Python's (`...Warning: ...`), loggers' (`WARNING`), and accelerate's
    about launch settings it had to default ("had defaults used instead").

    Args:
        log (`str`): The command's stderr (or stdout).
    """
    pattern = re.compile(r"\w+Warning: |\bWARNING\b|had defaults used instead")
    return [line for line in log.splitlines() if pattern.search(line)]
