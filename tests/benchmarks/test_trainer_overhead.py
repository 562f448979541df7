"""benchmarks/trainer_overhead.py: its documented command, shrunk, times the trainer beside a bare step of a copy."""

import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from benchmark_scripts import ENV, documented_commands, load_benchmark
from documents import ROOT
from test_models import TINY, make_model

from diffusers_lmlp.training.step import choose_precision


overhead = load_benchmark("trainer_overhead")


@pytest.mark.slow
def test_the_documented_command_times_the_trainer_beside_a_bare_step(tmp_path):
    # Shrunk: 12 steps of 4 samples from 64 images, eager (later options win), 2 bare steps every 5 trainer steps.
    shrink = ["--max_train_steps", "12", "--skip", "2", "--every", "5", "--bare_steps", "2", "--torch_compile", "no"]
    shrink += ["--train_batch_size", "4", "--shapes_num_images", "64", "--output_dir", str(tmp_path / "run")]
    [documented] = documented_commands("trainer_overhead")
    command = [sys.executable, *documented[1:], *shrink]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    # The preset's precision is `auto`: bf16 autocast where this CPU runs bf16 natively, float32 elsewhere.
    mode = "bf16" if choose_precision("auto")[0] == "bf16" else "fp32"
    assert f"the trainer's steps 3–12; the bare step ({mode}) 4 times between them" in result.stdout
    rows = r"^\| (the trainer's loop|its step function|bare step)[^|]* \| ([\d.]+) \|"
    rows = dict(re.findall(rows, result.stdout, re.M))
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


def test_the_bare_step_trains_a_copy_and_leaves_the_trainers_model_as_it_was():
    model = make_model("lmlp").train()
    accelerator = SimpleNamespace(mixed_precision="no", unwrap_model=lambda m, **_: m)
    timer = overhead.Timer(overhead.parse_args([])[0], step_function=None)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    timer.build_bare(
        accelerator, model, torch.zeros(3, TINY["in_channels"], TINY["sample_size"], TINY["sample_size"])
    )  # a first step, on a batch of the trainer's 3
    timer.bare()
    assert timer.bare_mode == "fp32" and all(torch.equal(v, before[name]) for name, v in model.state_dict().items())
