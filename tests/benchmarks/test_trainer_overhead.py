"""benchmarks/trainer_overhead.py times the trainer beside a bare step of a copy (benchmarks/training_step.py's)."""

import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from benchmark_scripts import ENV, documented_commands, load_benchmark
from documents import ROOT
from test_models import TINY, make_model

from diffusers_lmlp.training import components
from diffusers_lmlp.training.arguments import parse_args
from diffusers_lmlp.training.step import choose_precision


overhead, training_step = load_benchmark("trainer_overhead"), load_benchmark("training_step")


@pytest.mark.slow
def test_the_documented_command_times_the_trainer_beside_a_bare_step(tmp_path):
    # Shrunk: 12 steps of 4 samples from 64 images, eager (later options win), 2 bare steps every 5 trainer steps.
    shrink = ["--max_train_steps", "12", "--skip", "2", "--every", "5", "--bare_steps", "2", "--torch_compile", "no"]
    shrink += ["--train_batch_size", "4", "--shapes_num_images", "64", "--output_dir", str(tmp_path / "run")]
    command = [sys.executable, *documented_commands("trainer_overhead")[0][1:], *shrink]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    # The preset's precision is `auto`: bf16 autocast where this CPU runs bf16 natively, float32 elsewhere.
    mode = "bf16" if choose_precision("auto")[0] == "bf16" else "fp32"
    assert f"the trainer's steps 3–12; the bare step ({mode}) 4 times between them" in result.stdout
    rows = dict(
        re.findall(r"^\| (the trainer's loop|its step function|bare step)[^|]* \| ([\d.]+) \|", result.stdout, re.M)
    )
    assert set(rows) == {"the trainer's loop", "its step function", "bare step"}
    assert float(rows["the trainer's loop"]) >= float(rows["its step function"]) > 0 and float(rows["bare step"]) > 0
    # The step's parts, each timed where the trainer calls it, once per step; the bare step's calls not counted.
    parts = dict(re.findall(r"^\| ([^|]+?) \| ([\d.]+) \| [\d.]+% \|$", result.stdout, re.M))
    expected = {label for _, _, label in overhead.STEP_PARTS} | {label for _, _, label in overhead.INSTANCE_PARTS}
    assert set(parts) == expected and all(float(ms) > 0 for ms in parts.values()), parts
    assert float(parts["forward and loss"]) + float(parts["backward"]) < float(rows["its step function"]) * 1.5
    assert (tmp_path / "run" / "model_index.json").exists()  # the run itself finished and saved its pipeline


@pytest.mark.parametrize(
    "compiled, precision, mode",
    [(False, "no", "fp32"), (False, "bf16", "bf16"), (True, "no", "compile-fp32"), (True, "bf16", "compile-bf16")],
)
def test_the_bare_step_runs_in_the_mode_the_trainer_runs_its_model(compiled, precision, mode):
    model = make_model("lmlp")
    trained = torch.compile(model) if compiled else model  # wrapped as accelerate wraps it; nothing compiles yet
    assert overhead.bare_mode(SimpleNamespace(mixed_precision=precision), trained) == mode


def test_the_bare_step_trains_a_copy_and_leaves_the_trainers_model_as_it_was(monkeypatch):
    # With the trainer's fused AdamW: torch's slower default would flatter the trainer.
    made, copies, adamw, bare_step = [], [], torch.optim.AdamW, overhead.bare_step
    monkeypatch.setattr(torch.optim, "AdamW", lambda *a, **kw: made.append(kw) or adamw(*a, **kw))
    monkeypatch.setattr(overhead, "bare_step", lambda model, *a: copies.append(model) or bare_step(model, *a))
    model = make_model("lmlp").train()
    accelerator = SimpleNamespace(mixed_precision="no", unwrap_model=lambda m, **_: m)
    timer = overhead.Timer(overhead.parse_args([])[0], step_function=None)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    batch = torch.zeros(3, TINY["in_channels"], TINY["sample_size"], TINY["sample_size"])  # the trainer's first
    timer.build_bare(accelerator, model, batch)
    timer.bare()
    assert timer.bare_mode == "fp32" and all(torch.equal(v, before[name]) for name, v in model.state_dict().items())
    assert made == [{"lr": 1e-3, "fused": True}]
    assert all(not torch.equal(v, before[name]) for name, v in copies[0].named_parameters())


def test_the_command_times_a_step_and_the_optimizer_and_ema_alone(capsys):
    training_step.main(["--modes", "fp32", "--batch_size", "2", "--warmup", "1", "--steps", "2"])
    out = capsys.readouterr().out
    assert "| fp32 |" in out and "1.00×" in out
    updates = [line for line in out.splitlines() if line.startswith(("| AdamW", "| EMA"))]
    assert [line.split(" | ")[0][2:] for line in updates] == [
        "AdamW, torch's default", "AdamW, fused (the trainer's)",
        "EMA, diffusers' per-tensor loop", "EMA, diffusers' foreach (the trainer's)",
    ]  # fmt: skip
    assert all(float(line.split(" | ")[1].rstrip(" |")) > 0 for line in updates)
    assert "(139 weight tensors)" in out  # the preset's shapes-S's tensors, every one updated by each


@pytest.mark.parametrize("family, config", [("lmlp", "shapes-S"), ("moe_mlp", "shapes-moe-S")])
def test_the_step_timed_is_the_main_jobs_model(family, config):
    # The shapes preset's model options (its caption projection) included, as the trainer builds the model.
    timed = training_step.shapes_model(training_step.parse_args(["--family", family, "--config", config]))
    args = parse_args(["--output_dir", "x", "--model_type", family, "--model_config", config])
    trained = components.build_model(args.model_type, args.model_config, args.model_overrides)
    assert timed.config == trained.config and timed.config.pooled_text_projection
