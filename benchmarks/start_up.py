"""Start-up time of the package's commands: `import diffusers_lmlp`, each command's `--help` and an argument error,
against `import torch` (the floor: every command needs torch) and against importing diffusers' `ModelMixin` (what
the package's import cost before its names became lazy). Each is a fresh interpreter, run --repeats times in turn;
the table gives the median and its ratio to `import torch` from the same window.

    python benchmarks/start_up.py               # about a minute on 2 CPU cores
    python benchmarks/start_up.py --repeats 9

Run it on idle cores: only ratios measured in one window are claims.
"""

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

from diffusers_lmlp.commands import number
from diffusers_lmlp.cpu import this_cpu


# (what is measured, the interpreter's arguments, the exit code it must return)
CASES = [
    ("import torch", ["-c", "import torch"], 0),
    ("import diffusers; ModelMixin", ["-c", "from diffusers import ModelMixin"], 0),
    ("import diffusers_lmlp", ["-c", "import diffusers_lmlp"], 0),
    ("train --help", ["-m", "diffusers_lmlp.train", "--help"], 0),
    ("train: bad option", ["-m", "diffusers_lmlp.train", "--no_such_option"], 2),
    ("train: bad value", ["-m", "diffusers_lmlp.train", "--learning_rate", "-1"], 2),
    ("evaluation --help", ["-m", "diffusers_lmlp.evaluation", "--help"], 0),
    ("evaluation: no such folder", ["-m", "diffusers_lmlp.evaluation", "--pipeline", "./no-such-folder"], 2),
    ("hub --help", ["-m", "diffusers_lmlp.hub", "--help"], 0),
    ("hub push --help", ["-m", "diffusers_lmlp.hub", "push", "--help"], 0),
]


def seconds(arguments: list[str], exit_code: int) -> float:
    """Wall-clock seconds of one fresh interpreter running `arguments`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *arguments], capture_output=True, env=env, timeout=300)
    elapsed = time.perf_counter() - start
    if result.returncode != exit_code:
        raise SystemExit(f"{' '.join(arguments)} exited {result.returncode}:\n{result.stderr.decode()[-2000:]}")
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--repeats", type=number(int, 1), default=5, help="runs of each case, interleaved (default: 5)"
    )
    args = parser.parse_args(argv)
    times = {name: [] for name, _, _ in CASES}
    for _ in range(args.repeats):  # interleaved, so that a busy spell affects every case alike
        for name, arguments, exit_code in CASES:
            times[name].append(seconds(arguments, exit_code))
    floor = statistics.median(times["import torch"])
    print(
        f"Start-up, median of {args.repeats} fresh interpreters; CPU: {this_cpu().describe()}; Python {platform.python_version()}"
    )
    print()
    print("| command | seconds | × import torch |")
    print("|---|---:|---:|")
    for name, _, _ in CASES:
        median = statistics.median(times[name])
        print(f"| {name} | {median:.2f} | {median / floor:.2f} |")


if __name__ == "__main__":
    main()
