"""The scripts in benchmarks/ as the tests load them, and their commands as the README and docs/ write them."""

import importlib.util
import shlex
import sys
from types import ModuleType

import pytest
import torch
from documents import PAGES, ROOT, blocks


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/<name>.py` as a module, loaded with benchmarks/ on the import path, as when it runs as a script
    (the scripts import each other: `from speed_vs_uvit import ...`)."""
    folder = str(ROOT / "benchmarks")
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


def documented_commands(name: str) -> list[list[str]]:
    """The commands of `benchmarks/<name>.py` in the README and docs/ (their bash blocks), split as a shell would,
    comments dropped, in the pages' order."""
    return [
        shlex.split(line.split("#", 1)[0])
        for page in PAGES
        for block in blocks(page, "bash")
        for line in block.splitlines()
        if line.startswith(f"python benchmarks/{name}.py")
    ]


def check_the_commands_parse(parse_args, commands: list[list[str]], capsys) -> None:
    """Every option of every command exists and every value is valid; without a GPU, a `--device cuda` command is
    refused with the message that says so."""
    for command in commands:
        if "cuda" in command and not torch.cuda.is_available():
            with pytest.raises(SystemExit):
                parse_args(command[2:])
            assert "--device cuda needs a CUDA GPU" in capsys.readouterr().err
        else:
            parse_args(command[2:])
