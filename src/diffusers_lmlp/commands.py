"""What the package's commands share before any heavy import: how they name themselves in their usage lines, and
the argparse type that checks a number's range."""

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path


def program_name(console_script: str, module: str, argv0: str | None = None) -> str:
    """How the user ran a command, for its usage line: the console script's name, `python -m <module>`, or else the
    script's file name; `argv0` defaults to `sys.argv[0]`."""
    path = Path(sys.argv[0] if argv0 is None else argv0)
    if path.name.removesuffix(".exe") == console_script:
        return console_script
    # `python -m` starts a package's `__main__.py` or the module's own file.
    parts = module.split(".")
    started = path.parts
    package_main = started[-len(parts) - 1 :] == (*parts, "__main__.py")
    module_file = started[-len(parts) :] == (*parts[:-1], f"{parts[-1]}.py")
    if path.name in ("", "-c", "-m") or package_main or module_file:
        return f"python -m {module}"
    return path.name


def number(kind: type = int, low: float | None = None, *, above: float | None = None, below: float | None = None,
           why: str = "") -> Callable[[str], int | float]:  # fmt: skip
    """An argparse `type=`: a finite `kind` (int or float), at least `low`, more than `above`, less than `below`; `why`
    follows the range in the error ("argument --seed: must be >= 0 and < 4294967296, got -1")."""

    def parse(text: str) -> int | float:
        value = kind(text)  # a ValueError: argparse says "invalid int value: 'x'"
        inside = (
            (low is None or value >= low) and (above is None or value > above) and (below is None or value < below)
        )
        if not (math.isfinite(value) and inside):
            bounds = {">=": low, ">": above, "<": below}
            described = " and ".join(f"{sign} {bound}" for sign, bound in bounds.items() if bound is not None)
            finite = "a finite number " if kind is float else ""
            raise argparse.ArgumentTypeError(f"must be {finite}{described}{why}, got {value}")
        return value

    parse.__name__ = kind.__name__
    return parse
