"""benchmarks/gpu_check.py: its quick run on a CPU, its budget and failures, and its commands as the README's."""

import json
import shlex
import subprocess
import sys
import time
from unittest.mock import Mock

import pytest
from benchmark_scripts import load_benchmark
from documents import ROOT, blocks, text


check = load_benchmark("gpu_check")


@pytest.mark.slow
def test_the_quick_check_runs_every_part_but_emoji_on_a_cpu(tmp_path):
    output = tmp_path / "check.json"
    command = [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--output", str(output)]
    command += ["--parts", "parity", "padding", "speed", "main"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads(output.read_text())
    assert not results["errors"] and not results["skipped"] and results["machine"]["quick"]
    # The same device on both sides: fp32 is exact, bf16 autocast within its tolerance.
    assert len(results["parity"]) == 9 and all(r["fp32"]["relative_error"] == 0.0 for r in results["parity"])
    assert all(0 < r["bf16"]["relative_error"] <= r["bf16"]["tolerance"] for r in results["parity"])
    assert [r["tokens"] for r in results["padding"]] == [334, 336, 384]
    assert results["padding"][0]["time_per_useful_flop"] == 1.0
    modes = {(r["model"], r["pass_"], r["mode"]) for r in results["speed"]}
    assert modes == {(m, p, "eager") for m in ("U-ViT-S/2", "F2-deep", "4E2H") for p in ("sampling", "training")}
    assert all(r["mfu"] is None and r["of_gemm"] > 0 for r in results["speed"])
    # Met is decided on the unrounded value (0.7996 is not 0.8), against the threshold its label states.
    assert len(results["goals"]) == 4 and all(
        g["least"] == float(k[-3:]) and g["met"] == (g["value"] >= g["least"]) for k, g in results["goals"].items()
    )
    assert results["main"]["returncode"] == 0 and results["main"]["steps"] == 2
    assert set(results["main"]["scores"]) == {"train", "held-out"}
    table = output.with_suffix(".md").read_text()
    assert "## Speed" in table and "## Goals" in table and "## The trainer's commands" in table


def test_its_trainer_commands_are_the_readmes():
    lines = [line for block in blocks(text("README.md"), "bash") for line in block.splitlines()]
    at = {line: line.find("accelerate launch") for line in lines}
    readme = {shlex.join(shlex.split(line[start:])) for line, start in at.items() if start >= 0}
    for part, extra in check.COMMANDS.items():
        argv = ["accelerate", "launch", *check.TRAIN[len(check.LAUNCH) - 2 :], *extra]
        assert shlex.join(argv) in readme, part


def run_check(tmp_path, *argv: str) -> tuple[int, dict, str]:
    """`gpu_check.py --device cpu --quick *argv` in this process: its exit code, its JSON and its Markdown."""
    output = tmp_path / "check.json"
    code = check.main(["--device", "cpu", "--quick", *argv, "--output", str(output)])
    return code, json.loads(output.read_text()), output.with_suffix(".md").read_text()


BAD = {"model": "F2", "family": "UL-MLP", "fp32": {"relative_error": 1.0, "tolerance": 1e-4, "ok": False},
       "bf16": {"relative_error": 0.0, "tolerance": 5e-2, "ok": True}}  # fmt: skip
RAISES = Mock(side_effect=RuntimeError("no kernel"))
PARITIES = [(RAISES, {"parity": "RuntimeError: no kernel"}, "**parity failed**: RuntimeError: no kernel"),
            (lambda args: [BAD], {}, "| F2 | UL-MLP | 1.0e+00 | 0.0e+00 | **no** |")]  # fmt: skip


@pytest.mark.parametrize("parity, errors, shown", PARITIES, ids=["raises", "out of tolerance"])
def test_a_failed_parity_fails_the_check_the_next_part_runs_and_it_is_shown(
    parity, errors, shown, tmp_path, monkeypatch
):
    monkeypatch.setattr(check, "parity", parity)
    code, results, table = run_check(tmp_path, "--parts", "parity", "padding")
    assert code == 1 and results["errors"] == errors and len(results["padding"]) == 3 and shown in table


def test_a_part_that_would_start_past_the_budget_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(check, "parity", lambda args: time.sleep(1.2) or [])
    code, results, _ = run_check(tmp_path, "--parts", "parity", "padding", "--budget_s", "1")
    assert code == 0 and results["skipped"] == ["padding"] and "padding" not in results


def test_a_failure_mid_speed_keeps_the_models_measured_before_it(tmp_path, monkeypatch):
    measure, oom = check.speed.measure_model, Mock(side_effect=RuntimeError("out of memory"))
    monkeypatch.setattr(
        check.speed, "measure_model", lambda name, *a: (measure if name == "U-ViT-S/2" else oom)(name, *a)
    )
    monkeypatch.setattr(check.speed, "seconds", lambda step, device: 1.0)  # what is kept matters, not the times
    monkeypatch.setattr(check.speed, "time_interleaved", lambda steps, repeats, device: dict.fromkeys(steps, 1.0))
    code, results, _ = run_check(tmp_path, "--parts", "speed")
    assert code == 1 and results["errors"] == {"speed": "RuntimeError: out of memory"}
    assert {(r["model"], r["pass_"]) for r in results["speed"]} == {("U-ViT-S/2", p) for p in ("sampling", "training")}
