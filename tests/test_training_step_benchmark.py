"""benchmarks/training_step.py: its command runs and prints both tables, the step modes and the updates alone."""

import importlib.util
from pathlib import Path

import pytest


SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "training_step.py"


@pytest.fixture(scope="module")
def benchmark():
    spec = importlib.util.spec_from_file_location("training_step_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_times_a_step_and_the_optimizer_and_ema_alone(benchmark, capsys):
    benchmark.main(["--modes", "fp32", "--batch_size", "2", "--warmup", "1", "--steps", "2"])
    out = capsys.readouterr().out
    assert "| fp32 |" in out and "1.00×" in out
    updates = [line for line in out.splitlines() if line.startswith(("| AdamW", "| EMA"))]
    assert [line.split(" | ")[0][2:] for line in updates] == [
        "AdamW, torch's default",
        "AdamW, fused (the trainer's)",
        "EMA, per-tensor loop",
        "EMA, foreach (the trainer's)",
    ]
    assert all(float(line.split(" | ")[1].rstrip(" |")) > 0 for line in updates)
    assert "(137 weight tensors)" in out  # shapes-S's tensors, every one updated by each
