"""`--logging_steps`: each window's mean at its last step, a partial window's at the end or at a stop; never a NaN."""

import math
from unittest.mock import Mock

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_train_divergence import all_finite
from test_train_text_to_image import train_args
from test_train_validation import start_up_error

from diffusers_lmlp.training import step as step_module
from diffusers_lmlp.training import trainer


@pytest.fixture
def values(monkeypatch) -> list[tuple[float, float]]:
    """Each optimizer step's (loss, gradient norm), as the trainer gets them."""
    values, take_step = [], trainer.training_step

    def recorded(*args, **kwargs):
        result = take_step(*args, **kwargs)
        values.append((result.loss.item(), result.grad_norm.item()))
        return result

    monkeypatch.setattr(trainer, "training_step", recorded)
    return values


def logged(output_dir, name: str = "loss") -> list[tuple[int, float]]:
    events = EventAccumulator(str(output_dir / "logs" / "lmlp-text-to-image")).Reload()
    return [(event.step, event.value) for event in events.Scalars(name)]


@pytest.mark.slow
def test_tensorboard_gets_each_windows_means_and_the_last_partial_window(script, workspace, tmp_path, values):
    out = tmp_path / "out"
    argv = [*train_args(workspace, out), "--max_train_steps", "7", "--checkpointing_steps", "7"]
    script.main([*argv, "--report_to", "tensorboard", "--logging_steps", "3", "--lr_scheduler", "linear"])
    assert len(values) == 7
    for column, name in enumerate(("loss", "grad_norm")):
        per_step = [step[column] for step in values]
        expected = [(3, sum(per_step[:3]) / 3), (6, sum(per_step[3:6]) / 3), (7, per_step[6])]
        assert logged(out, name) == [(step, pytest.approx(mean, rel=1e-6)) for step, mean in expected]
    lr = [value for _, value in logged(out, "lr")]  # each window's last step's: linear decay from 1e-3 over 7 steps
    assert lr == pytest.approx([1e-3 * (7 - s) / 7 for s in (3, 6, 7)], abs=1e-9)


@pytest.mark.slow
def test_a_nan_loss_stops_keeping_good_checkpoints_and_logs_no_nan(script, workspace, tmp_path, monkeypatch, values):
    # Steps 1-4 train, then the loss is NaN; checkpoints every 2 steps, at most 1 kept: checkpoint-4 must survive.
    loss = step_module.diffusion_loss
    monkeypatch.setattr(step_module, "diffusion_loss", calls := Mock())  # one micro-batch per step
    calls.side_effect = lambda *args, **kwargs: loss(*args, **kwargs) * (float("nan") if calls.call_count >= 5 else 1)
    out = tmp_path / "out"
    argv = [*train_args(workspace, out), "--max_train_steps", "8", "--checkpointing_steps", "2", "--use_ema"]
    argv += ["--checkpoints_total_limit", "1", "--report_to", "tensorboard", "--logging_steps", "3"]
    message = start_up_error(script, argv)
    assert message.startswith("error: the loss is nan at step 5 (gradient norm nan)")
    good = out / "checkpoint-2"  # checkpoint-4's weights are the ones step 5 diverged from
    assert f"the newest checkpoint that later steps confirmed is {good}: resume from it with " in message
    assert f"--resume_from_checkpoint {good} (checkpoint-4, saved just before this step, may hold" in message
    assert "a lower --learning_rate (now 0.001)" in message and "--max_grad_norm 1.0" in message
    # The newest checkpoint stays out of the rotation until the steps after it prove healthy.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert all_finite(out / "checkpoint-4")
    assert not (out / "model_index.json").exists() and not (out / "training_summary.json").exists()
    assert calls.call_count == 5 and len(values) == 4  # stopped at the first NaN, not trained on; steps 1-4 finished
    losses = logged(out)
    assert [step for step, _ in losses] == [3, 4]  # step 4, of the unfinished window, sent when the run stopped
    assert losses[1][1] == pytest.approx(values[3][0], rel=1e-6) and all(math.isfinite(v) for _, v in losses)
