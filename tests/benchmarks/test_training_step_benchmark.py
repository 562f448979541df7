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
        "AdamW, torch's default", "AdamW, fused (the trainer's)",
        "EMA, diffusers' per-tensor loop", "EMA, diffusers' foreach (the trainer's)",
    ]  # fmt: skip
    assert all(float(line.split(" | ")[1].rstrip(" |")) > 0 for line in updates)
    assert "(139 weight tensors)" in out  # the preset's shapes-S's tensors, every one updated by each


@pytest.mark.parametrize("family", ["lmlp", "moe_mlp"])
def test_the_step_timed_is_the_main_jobs_model(benchmark, family):
    # The shapes preset's model options (its caption projection) included, as the trainer builds the model.
    from diffusers_lmlp.training import components
    from diffusers_lmlp.training.arguments import parse_args

    config = {"lmlp": "shapes-S", "moe_mlp": "shapes-moe-S"}[family]
    timed = benchmark.shapes_model(benchmark.parse_args(["--family", family, "--config", config]))
    args = parse_args(["--output_dir", "x", "--model_type", family, "--model_config", config])
    trained = components.build_model(args.model_type, args.model_config, args.model_overrides)
    assert timed.config == trained.config and timed.config.pooled_text_projection


def test_the_bare_step_steps_adamw_with_the_trainers_kernel(benchmark, monkeypatch):
    """The bare step uses the trainer's fused AdamW (torch's slower default would flatter the trainer) and trains."""
    import torch

    from diffusers_lmlp.tiny import build_tiny_pipeline

    made = []
    adamw = torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW", lambda *a, **kw: made.append(kw) or adamw(*a, **kw))
    model = build_tiny_pipeline().transformer
    before = [p.detach().clone() for p in model.parameters()]
    benchmark.bare_step(model, 2, "fp32")()
    assert made == [{"lr": 1e-3, "fused": True}]
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
