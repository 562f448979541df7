"""benchmarks/training_step.py: its command runs and prints both tables, the step modes and the updates alone."""

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def benchmark():
    return load_benchmark("training_step")


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
