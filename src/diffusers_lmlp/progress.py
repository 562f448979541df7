"""Progress bars: tqdm's in a terminal; in a log file, where tqdm would pile carriage-return updates onto one line,
a `LineProgress` of plain lines (`steps:  50% 1300/2600, 04:12 elapsed, ETA 04:12, 5.15it/s, loss=0.0412`).
"""

import math
import sys
import time
from typing import TextIO

from tqdm.auto import tqdm
from tqdm.autonotebook import tqdm as console_or_notebook_tqdm  # imported by tqdm.auto, without its warning
from tqdm.std import tqdm as plain_tqdm


# A line at every 5% of the total, and at least one a minute.
LINE_EVERY_FRACTION = 0.05
LINE_EVERY_SECONDS = 60.0


class LineProgress:
    """tqdm's interface as the project uses it, for log files: a line at every `every_fraction` of `total`, at least
    one every `every_seconds`, and one on close if the count moved. Speed and ETA leave out the steps before
    `initial` (a resumed run's)."""

    def __init__(
        self, total: int, desc: str = "", initial: int = 0, unit: str = "it", file: TextIO | None = None,
        every_fraction: float = LINE_EVERY_FRACTION, every_seconds: float = LINE_EVERY_SECONDS,
    ):  # fmt: skip
        self.total, self.desc, self.unit = total, desc, unit
        self.n = self.initial = self.last_n = initial
        self.file = file or sys.stderr
        self.stride = max(1, math.ceil(total * every_fraction))
        self.every_seconds = every_seconds
        self.postfix = ""
        self.start = self.last_time = time.monotonic()
        self.next_n = (initial // self.stride + 1) * self.stride  # where the next line is due

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.n >= self.next_n or now - self.last_time >= self.every_seconds:
            self.write_line(now)

    def set_postfix(self, refresh: bool = True, **values) -> None:  # `refresh`: tqdm's, ignored here
        self.postfix = ", ".join(f"{name}={value}" for name, value in values.items())

    def close(self) -> None:
        if self.n != self.last_n:
            self.write_line(time.monotonic())

    def write_line(self, now: float) -> None:
        elapsed = now - self.start
        rate = (self.n - self.initial) / elapsed if elapsed > 0 and self.n > self.initial else None
        if rate is None:
            speed, eta = f"?{self.unit}/s", "?"
        else:
            speed = f"{rate:.2f}{self.unit}/s" if rate >= 1 else f"{1 / rate:.2f}s/{self.unit}"
            eta = plain_tqdm.format_interval((self.total - self.n) / rate)
        line = (
            f"{self.desc}: {100 * self.n / max(self.total, 1):3.0f}% {self.n}/{self.total}, "
            f"{plain_tqdm.format_interval(elapsed)} elapsed, ETA {eta}, {speed}"
        )
        self.file.write(line + (f", {self.postfix}" if self.postfix else "") + "\n")
        self.file.flush()
        self.last_n, self.last_time = self.n, now
        self.next_n = (self.n // self.stride + 1) * self.stride

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is a terminal (where a bar redrawn in place is right), or we run in Jupyter (tqdm's widget)."""
    if console_or_notebook_tqdm is not plain_tqdm:
        return True
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def progress_bar(
    total: int, desc: str, *, initial: int = 0, unit: str = "it", disable: bool = False, file: TextIO | None = None
) -> tqdm | LineProgress:
    """A progress bar for `total` steps: tqdm's in a terminal, a `LineProgress` anywhere else. Call
    `set_postfix(..., refresh=False)` before `update`, so that the line a step writes shows that step's values."""
    stream = file or sys.stderr
    if disable or is_terminal(stream):
        return tqdm(total=total, desc=desc, initial=initial, unit=unit, disable=disable, file=file)
    return LineProgress(total, desc, initial=initial, unit=unit, file=stream)
