"""The warning that other work keeps the cores busy (`diffusers_lmlp.threads.busy_cores_warning`): given when another
process runs now, and not a minute after a `pip install` has finished, as the README's main command starts. The
kernel's counts are read from a stand-in of `/proc` where the test needs them exact (the suite's other worker
keeps a core busy), and from the real one where another process is started."""

import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

from diffusers_lmlp import threads


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def fake_proc(folder: Path, running: int, own_states: str) -> Path:
    """A `/proc` with `running` tasks running machine-wide, and this process's threads in `own_states` (one letter
    each, `R` running, `S` sleeping), written as the kernel writes them."""
    (folder / "loadavg").write_text(f"1.30 1.90 2.00 {running}/79 1757\n")
    for tid, state in enumerate(own_states, start=100):
        (folder / "self" / "task" / str(tid)).mkdir(parents=True)
        (folder / "self" / "task" / str(tid) / "stat").write_text(f"{tid} (pt_main thread) {state} 1 2 3 4 5\n")
    return folder


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 2)


def test_a_load_average_left_by_finished_work_is_not_taken_for_work_running_now(two_cores, monkeypatch, tmp_path):
    """What `pip install` leaves: the 1-minute load average at 1.3, and only this process's reading thread running."""
    proc = fake_proc(tmp_path, running=1, own_states="RSSS")
    monkeypatch.setattr(os, "getloadavg", lambda: (1.3, 1.9, 2.0))
    measure = threads.busy_cores_of_others
    monkeypatch.setattr(threads, "busy_cores_of_others", lambda: measure(proc=proc))
    assert threads.busy_cores_of_others() == 0.0
    assert threads.busy_cores_warning(2) is None


@pytest.mark.parametrize(
    "running, own_states, expected",
    [(1, "R", 0.0), (3, "RSS", 2.0), (3, "RRR", 0.0), (2, "RR", 0.0), (4, "RRS", 2.0), (1, "SS", 0.0)],
)
def test_this_process_s_own_running_threads_are_not_counted(tmp_path, running, own_states, expected):
    """Torch's threads spin for a moment after a parallel region: they are this process's, not other work. The
    reading thread is always one of this process's running threads."""
    proc = fake_proc(tmp_path, running, own_states)
    assert threads.busy_cores_of_others(samples=3, interval=0.0, proc=proc) == expected


def test_a_stat_line_whose_thread_name_holds_spaces_and_parentheses_is_read(tmp_path):
    proc = fake_proc(tmp_path, running=2, own_states="")
    (proc / "self" / "task" / "7").mkdir(parents=True)
    (proc / "self" / "task" / "7" / "stat").write_text("7 (a (b) c) R 1 2 3\n")
    (proc / "self" / "task" / "8").mkdir(parents=True)
    (proc / "self" / "task" / "8" / "stat").write_text("8 (x) S 1 2 3\n")
    assert threads.own_running_threads(proc) == 1
    assert threads.busy_cores_of_others(samples=1, proc=proc) == 1.0


@pytest.mark.skipif(not os.path.exists("/proc/loadavg"), reason="reads Linux's /proc")
def test_another_process_running_now_is_seen_and_named(two_cores):
    worker = multiprocessing.get_context("spawn").Process(target=spin, args=(60.0,))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while threads.busy_cores_of_others() < 0.9 and time.monotonic() < deadline:  # until it runs
            time.sleep(0.1)
        busy = threads.busy_cores_of_others()
        warning = threads.busy_cores_warning(2)
    finally:
        worker.kill()
        worker.join()
    assert busy >= 0.8
    assert warning is not None and "of the 2 cores busy" in warning and "pass --num_threads 1" in warning


def test_without_proc_the_load_average_decides(two_cores, monkeypatch, tmp_path):
    assert threads.busy_cores_of_others(proc=tmp_path / "absent") is None
    monkeypatch.setattr(threads, "busy_cores_of_others", lambda: None)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.3, 1.0, 1.0))
    assert "other work keeps 1.3 of the 2 cores busy" in threads.busy_cores_warning(2)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 1.0, 1.0))
    assert threads.busy_cores_warning(2) is None


def test_the_warning_is_logged_when_threads_are_applied(two_cores, monkeypatch, caplog):
    monkeypatch.setattr(threads, "busy_cores_of_others", lambda: 1.0)
    count = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger=threads.__name__):
            threads.apply_threads(threads.ThreadChoice(2, "every core"), "training")
    finally:
        torch.set_num_threads(count)
    assert "training on the CPU: 2 thread(s)" in caplog.text
    assert "other work keeps 1.0 of the 2 cores busy" in caplog.text
    assert threads.busy_cores_warning(1) is None  # one thread always has a core
