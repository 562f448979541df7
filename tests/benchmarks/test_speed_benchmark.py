"""benchmarks/speed_vs_uvit.py: its pieces against plain arithmetic, and smoke runs of its command."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch
from benchmark_scripts import ENV, documented_commands, load_benchmark
from documents import ROOT
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode


speed = load_benchmark("speed_vs_uvit")


@pytest.mark.parametrize("answer", [0, 1, 5, 31, 32, 33, 100, 511, 512, 777, 8192])
def test_largest_batch_finds_the_boundary(answer):
    tried = []
    assert speed.largest_batch(lambda batch: tried.append(batch) or batch <= answer) == answer
    assert len(tried) <= 2 * 14  # doubling, then bisecting: logarithmic in the answer


@pytest.mark.parametrize("train", [False, True], ids=["forward", "training"])
@pytest.mark.parametrize("name", ["U-ViT-S/2", "4E2H"])
def test_gemm_reference_runs_every_matmul_of_the_pass(name, train):
    # The GEMM-only reference has exactly the pass's matmul FLOPs (torch's counter, less the patch convolution).
    operands = speed.meta_pass(name, 2, 3, train)[1]
    replayed = sum(2 * math.prod(a) * b[-1] for _, a, _, b, _ in operands)
    model = speed.build(name, num_layers=2, device="meta")
    data = speed.inputs(model.config, 3, "meta")
    with FlopCounterMode(display=False) as counter:
        out = model(data["latents"], data["text"], data["timesteps"]).sample
        if train:
            out.pow(2).mean().backward()
    convolution = sum(flops for op, flops in counter.get_flop_counts()["Global"].items() if "convolution" in str(op))
    assert convolution > 0 and replayed == counter.get_total_flops() - convolution
    if name == "U-ViT-S/2":  # attention's QKᵀ and AV are among them: (B·H, L, d) × (B·H, d, L)
        assert any(batched and a[1:] == (334, 64) for batched, a, _, _, _ in operands)
    speed.gemm_step(operands[:3], "cpu", "fp32")()  # the recorded layouts are valid to rebuild


def test_speedup_compares_best_modes_in_the_same_window():
    # The 4E2H's timed in another window: U-ViT's best ran at 2.0 and F2-deep's best at 2.2 beside it.
    rows = [
        speed.Row(model, "family", 1, 8, "fp32", mode, "sampling", images, 100.0, 200.0, 0.0, baseline, reference)
        for model, mode, images, baseline, reference in [
            (speed.BASELINE, "eager", 2.0, {}, None),
            (speed.BASELINE, "compile", 2.5, {}, None),
            ("F2-deep", "eager", 2.4, {"eager": 2.0, "compile": 2.4}, None),
            ("F2-deep", "compile", 3.0, {"eager": 2.1, "compile": 2.5}, None),
            ("4E2H", "eager", 1.8, {"eager": 1.6, "compile": 2.0}, {"eager": 1.9, "compile": 2.2}),
            ("4E2H", "regional", 2.3, {"eager": 1.7, "compile": 2.0}, {"eager": 1.9, "compile": 2.2}),
        ]
    ]
    best = {key[0]: row for key, row in speed.best_rows(rows).items() if key[1:] == (8, "fp32", "sampling")}
    assert best["F2-deep"].mode == "compile" and speed.speedup(best["F2-deep"], rows) == pytest.approx(3.0 / 2.5)
    summary = speed.summary_table(rows).splitlines()
    # Best 3.0 over U-ViT's best 2.5 in the same window; eager 2.4 over U-ViT's eager 2.0; F2-deep over itself.
    assert summary[-2] == "| F2-deep | 8 | fp32 | compile | 1.20× | – | – | 1.20× | 1.00× | 1.00× |"
    assert summary[-3] == "| U-ViT-S/2 | 8 | fp32 | compile | 1.00× | – | – | 1.00× | 1.20× | 1.20× |"
    # 4E2H over F2-deep from its own window (2.2 / 2.3, eager 1.9 / 1.8), not through two U-ViT ratios (1.04×, 1.07×).
    assert summary[-1] == "| 4E2H | 8 | fp32 | regional | 1.15× | – | – | 1.12× | 0.96× | 1.06× |"
    assert speed.reference_time_ratio(best["4E2H"], rows) == pytest.approx(2.2 / 2.3)
    assert speed.eager_time_ratio(rows[4], rows) == pytest.approx(1.9 / 1.8)
    assert speed.eager_time_ratio(rows[0], rows) == pytest.approx(2.4 / 2.0)  # U-ViT: F2-deep's eager window
    assert rows[3].of_gemm == pytest.approx(0.5)


def test_the_training_step_uses_the_trainers_adamw_kernel(monkeypatch):
    # As the trainer does: torch's fused kernel (the default loop would cost the MoE-MLP's experts more).
    made, adamw = [], torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW", lambda *a, **kw: made.append(kw) or adamw(*a, **kw))
    model = speed.build("4E2H", num_layers=2)
    before = [p.detach().clone() for p in model.parameters()]
    step = speed.training_step(model, model, speed.inputs(model.config, 2, "cpu"), "cpu", "fp32")
    assert torch.isfinite(step()) and made == [{"lr": 1e-6, "fused": True}]
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_gpu_peak_comes_from_the_name_or_the_measured_gemm(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert speed.gpu_peak_tflops(700.0)[0] == 989.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some Future GPU")
    assert speed.gpu_peak_tflops(700.0)[0] == 700.0 and "measured bf16 GEMM" in speed.gpu_peak_tflops(700.0)[1]


# A smoke run (later options win): depth 2, batch 2, one repeat, eager, fp32, a 2-step pipeline, one memory probe.
SMOKE = """--models 4E2H F2-deep --modes eager --precisions fp32 --num_layers 2 --batch_size 2 --repeats 1
--pipeline_models F2-deep --pipeline_steps 2 --pipeline_batch_size 1 --memory_models F2-deep""".split()


@pytest.mark.slow
def test_the_documented_command_runs(tmp_path):
    # docs/benchmarks.md's first command, shrunk: every section writes its table, the JSON and the plot.
    command = [sys.executable, *documented_commands("speed_vs_uvit")[0][1:], "--output_dir", str(tmp_path), *SMOKE]
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = (tmp_path / "results.md").read_text()
    assert all(f"## {title}" in report for title in ("Best mode per model", "Every mode", "The pipeline", "Memory"))
    data = json.loads((tmp_path / "results.json").read_text())
    passes = {(m, p) for m in ("U-ViT-S/2", "F2-deep", "4E2H") for p in ("sampling", "training")}
    assert {(r["model"], r["pass_"]) for r in data["rows"]} == passes
    assert all(r["images_per_second"] > 0 and r["gflops"] > 0 for r in data["rows"])
    by_model = {r["model"]: r for r in data["rows"] if r["pass_"] == "sampling"}
    f2, moe = by_model["F2-deep"], by_model["4E2H"]  # U-ViT timed in F2-deep's window; both in the MoE-MLP's
    assert set(f2["baseline_images_per_second"]) == {"eager"} and f2["reference_images_per_second"] == {}
    assert set(moe["baseline_images_per_second"]) == set(moe["reference_images_per_second"]) == {"eager"}
    summary = report.split("## Every mode")[0]
    ratio = moe["reference_images_per_second"]["eager"] / moe["images_per_second"]
    # Eager is the only mode, so the best modes' and the eager columns read the same ratios.
    pattern = rf"\| 4E2H \|.*\| {ratio:.2f}× / ([0-9.]+×) \| {ratio:.2f}× / \1 \|$"
    assert re.search(pattern, summary, flags=re.MULTILINE), summary
    assert data["pipeline"][0]["steps"] == 2 and data["pipeline"][0]["ratio"] > 0
    # A depth-2 F2-deep training step at batch 2 needs tens of MiB; gradient checkpointing saves some of it.
    memory = data["memory"][0]
    assert 20 * 2**20 < memory["bytes"] < 400 * 2**20 and memory["checkpointing_bytes"] < 0.9 * memory["bytes"]
    with Image.open(tmp_path / "speed.png") as plot:
        assert plot.width > 400 and plot.height > 80


def test_sampling_only_modes_time_sampling_alone(monkeypatch):
    """Beside eager, `frozen` times sampling only (alone, it skips training: the run below); which steps are made."""
    monkeypatch.setattr(speed, "make_runner", lambda model, mode: model)
    monkeypatch.setattr(speed, "seconds", lambda step, device: 1.0)
    monkeypatch.setattr(speed, "time_interleaved", lambda steps, repeats, device: dict.fromkeys(steps, 1.0))
    trained, meta_pass = [], speed.meta_pass
    monkeypatch.setattr(speed, "meta_pass", lambda *a, train: trained.append(train) or meta_pass(*a, train=train))
    args = speed.parse_args("--models F2-deep --modes eager frozen --num_layers 2 --batch_size 2 --repeats 1".split())
    rows, steps = speed.measure_model("F2-deep", args, "fp32", {})
    assert {(r.pass_, r.mode) for r in rows} == {("sampling", "eager"), ("sampling", "frozen"), ("training", "eager")}
    assert set(steps["training"]) == {"eager"} and trained == [False, True]


@pytest.mark.slow
def test_the_frozen_mode_compiles_and_the_pipeline_samples_with_it(tmp_path, monkeypatch):
    # Each model's frozen compilation is timed; the pipeline section freezes its backbone when frozen is the best mode.
    two_blocks = {"down_block_types": ("DownEncoderBlock2D",) * 2, "up_block_types": ("UpDecoderBlock2D",) * 2}
    tiny_vae = {**speed.SD_VAE_CONFIG, **two_blocks, "block_out_channels": (8, 16), "norm_num_groups": 4}
    monkeypatch.setattr(speed, "SD_VAE_CONFIG", tiny_vae)  # the SD VAE's decode is the documented command's to time
    only = [speed.BASELINE, "--pipeline_models", speed.BASELINE, "--memory_models"]  # two compilations, no more
    # main raises dynamo's recompile_limit; config.patch puts it back (monkeypatch would delete the setting)
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):
        speed.main([*SMOKE, "--modes", "frozen", "--models", *only, "--output_dir", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    [row] = data["rows"]
    assert (row["model"], row["pass_"], row["mode"]) == (speed.BASELINE, "sampling", "frozen")
    assert row["images_per_second"] > 0 and row["compile_seconds"] > 0
    assert data["pipeline"][0]["mode"] == "frozen" and data["pipeline"][0]["ratio"] > 0
