"""The scripts of benchmarks/ (and scripts/) as the tests load them, and their commands as the docs write them."""

import importlib.util
import os
import shlex
import sys
from types import ModuleType

import pytest
import torch
from documents import PAGES, ROOT, blocks


ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}  # of a script run on one thread, offline


def load_benchmark(name: str, folder: str = "benchmarks") -> ModuleType:
    """`<folder>/<name>.py` as a module, its folder on the import path while it loads (scripts import each other)."""
    folder = str(ROOT / folder)
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, f"{folder}/{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def documented_commands(name: str) -> list[list[str]]:
    """The commands of `benchmarks/<name>.py` in the README's and docs/' bash blocks, split as a shell would."""
    return [
        shlex.split(line.split("#", 1)[0])
        for page in PAGES
        for block in blocks(page, "bash")
        for line in block.splitlines()
        if line.startswith(f"python benchmarks/{name}.py")
    ]


def assert_refused(parse_args, argv: list[str], message: str, capsys) -> None:
    """`parse_args(argv)` exits, its error naming `message`."""
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def check_the_commands_parse(parse_args, commands: list[list[str]], capsys, cuda_by_default: bool = False) -> None:
    """Every command parses; without a GPU, one on cuda (`--device cuda`, or none if `cuda_by_default`) is refused."""
    for command in commands:
        on_cuda = "cuda" in command or (cuda_by_default and "--device" not in command)
        if on_cuda and not torch.cuda.is_available():
            assert_refused(parse_args, command[2:], "--device cuda needs a CUDA GPU", capsys)
        else:
            parse_args(command[2:])
