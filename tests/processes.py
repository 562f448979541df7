"""Running a command whose processes may hang (a multi-process launch) without hanging the suite, and its warnings."""

import re
import signal
import subprocess
from contextlib import suppress

import psutil


def run_bounded(argv: list[str], *, env: dict, timeout: float, cwd=None) -> subprocess.CompletedProcess:
    """Run `argv` (with `PYTHONFAULTHANDLER=1`); when it outlives `timeout` s, SIGABRT it and all its descendants (each
    prints its threads' stacks), kill what is left and fail with the stderr: a hang is diagnosable and leaves no
    process spinning."""
    env = {**env, "PYTHONFAULTHANDLER": "1"}
    process = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        for member in tree:
            with suppress(psutil.NoSuchProcess):  # it may have ended meanwhile
                member.send_signal(signal.SIGABRT)
        for member in psutil.wait_procs(tree, timeout=10)[1]:
            with suppress(psutil.NoSuchProcess):
                member.kill()
        stdout, stderr = process.communicate()
        raise AssertionError(f"{argv[:6]} … hung for {timeout} s; the stacks of its processes:\n{stderr[-12000:]}")
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def warnings_in(log: str) -> list[str]:
    """The warning lines of a command's output: Python's, loggers', and accelerate's about settings it defaulted."""
    pattern = re.compile(r"\w+Warning: |\bWARNING\b|had defaults used instead")
    return [line for line in log.splitlines() if pattern.search(line)]
