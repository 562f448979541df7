"""`--torch_compile`: compiled where asked or (`auto`) where it works and pays, else uncompiled; same results."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_train_text_to_image import ENV, train, train_here, weights

from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.training.step import AUTO_MIN_STEPS, choose_compilation


@pytest.mark.slow
def test_choices_and_what_auto_weighs(monkeypatch):
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    given = ((None, 5200), ("yes", 10), ("no", 5200))
    assert [choose_compilation(*g) for g in given] == [(None, ""), ("inductor", ""), ("no", "")]
    backend, why = choose_compilation("auto", AUTO_MIN_STEPS - 1)
    assert backend == "no" and f"{AUTO_MIN_STEPS - 1} steps do not repay a compilation; --torch_compile yes" in why
    backend, why = choose_compilation("auto", AUTO_MIN_STEPS)
    assert backend == "inductor" and "inductor works here, a trial compilation took" in why
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")  # what accelerate launch sets when not asked
    assert choose_compilation("auto", AUTO_MIN_STEPS)[0] == "inductor"
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "AOT_EAGER")  # accelerate launch --dynamo_backend aot_eager
    assert choose_compilation("auto", AUTO_MIN_STEPS) == (None, " (auto: the launch's aot_eager is kept)")


@pytest.mark.slow
def test_auto_trains_uncompiled_where_compilation_fails(tmp_path):
    """No working C++ compiler (and a fresh inductor cache): auto says why and does not compile."""
    env = {**ENV, "CXX": str(tmp_path / "no-such-g++"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("ACCELERATE_DYNAMO_BACKEND", None)
    code = "from diffusers_lmlp.training.step import choose_compilation as c; print(*c('auto', 5200), sep='|')"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    backend, why = result.stdout.strip().splitlines()[-1].split("|")
    assert backend == "no" and "torch.compile does not work here" in why
    assert "no-such-g++" in why and "training uncompiled" in why


@pytest.mark.slow
def test_a_compiled_run_checkpoints_resumes_validates_and_matches_an_uncompiled_one(workspace):
    steps = "--max_train_steps 4 --checkpointing_steps 2 --validation_steps 2 --validation_prompts".split()
    steps.append("a red circle")
    assert "torch.compile no" in train_here(workspace, "plain", *steps, "--torch_compile", "no").stderr
    assert "torch.compile inductor" in train(workspace, "compiled", *steps, "--torch_compile", "yes").stderr
    # Resumed from step 2 under accelerate's regional compilation, the run ends where the uncompiled reference did,
    # with its keys (no `_orig_mod.`).
    out, plain = workspace / "compiled", workspace / "plain"
    os.rename(out / "checkpoint-4", workspace / "compiled-checkpoint-4")
    launch = "-m accelerate.commands.launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend"
    launch = [*launch.split(), "inductor", "--dynamo_use_regional_compilation"]
    resumed = train(
        workspace, out.name, *steps, "--resume_from_checkpoint", str(out / "checkpoint-2"), launcher=launch
    )
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in resumed.stderr
    assert "torch.compile inductor" in resumed.stderr
    assert not [p for p in (out / "checkpoint-4").rglob("*.safetensors") for key in load_file(p) if "_orig_mod" in key]
    for run, reference in [(workspace / "compiled-checkpoint-4", plain / "checkpoint-4"), (out, plain)]:
        run, reference = weights(run), weights(reference)
        assert set(run) == set(reference)
        for key, value in reference.items():
            torch.testing.assert_close(run[key], value, rtol=1e-3, atol=1e-4, msg=key)
    assert sorted(p.name for p in (out / "validation").glob("*.png")) == ["step-0000002.png", "step-0000004.png"]
    LMLPPipeline.from_pretrained(out)
    assert json.loads((out / "training_summary.json").read_text())["steps"] == 4
