"""A NaN, inf or exploded loss or gradient norm stops the trainer at that step, before anything of it is applied or
written, saying what to try; the good checkpoints stay, rotation included."""

import collections
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train_text_to_image import train_args

from diffusers_lmlp.durable import write_checksums
from diffusers_lmlp.training import step as step_module
from diffusers_lmlp.training.checkpoints import require_finite_weights
from diffusers_lmlp.training.step import EXPLOSION_WINDOW, DivergenceError, check_finite, non_finite_parameters


def stop_message(script, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stopped:
        script.main(argv)
    assert isinstance(stopped.value.code, str), stopped.value.code
    return stopped.value.code


def all_finite(folder: Path) -> bool:
    return all(torch.isfinite(t).all() for f in folder.rglob("*.safetensors") for t in load_file(f).values())


def nan_loss_from_step(monkeypatch, step: int) -> list[int]:
    """Make the loss NaN from optimizer step `step` on (one micro-batch per step); returns the list counting its calls."""
    loss, calls = step_module.diffusion_loss, []

    def nan_from_step(*args, **kwargs):
        calls.append(1)
        value = loss(*args, **kwargs)
        return value * float("nan") if len(calls) >= step else value

    monkeypatch.setattr(step_module, "diffusion_loss", nan_from_step)
    return calls


def test_a_learning_rate_that_diverges_stops_the_run_without_writing_nan(script, workspace, tmp_path):
    out = tmp_path / "out"
    argv = [*train_args(workspace, out), "--learning_rate", "1e9", "--max_train_steps", "20", "--checkpointing_steps"]
    message = stop_message(script, [*argv, "1", "--adam_epsilon", "1e-30"])
    assert "is nan" in message or "is inf" in message or "hold NaN or inf" in message, message
    assert "a lower --learning_rate (now 1e+09)" in message
    for checkpoint in out.glob("checkpoint-*"):
        assert all_finite(checkpoint), checkpoint
    assert not (out / "model_index.json").exists()


def test_check_finite_refuses_nan_inf_and_a_finite_explosion_against_the_steps_before():
    check_finite(torch.tensor(0.5), torch.tensor(1.0), step=3)
    for loss, norm in ((math.nan, 1.0), (math.inf, 1.0), (0.5, math.nan), (0.5, math.inf)):
        with pytest.raises(DivergenceError, match=r"at step 7 \(gradient norm"):
            check_finite(torch.tensor(loss), torch.tensor(norm), step=7)
    history = collections.deque(maxlen=EXPLOSION_WINDOW)
    for step in (1, 2, 3):
        check_finite(torch.tensor(0.5), torch.tensor(2.0), step, history)
    check_finite(torch.tensor(4000.0), torch.tensor(2.0), 4, history)  # 8000× the median: within the bound
    with pytest.raises(
        DivergenceError, match=r"loss is 8000.0 at step 5 .*over 10000× the median of the last 4 steps"
    ):
        check_finite(torch.tensor(8000.0), torch.tensor(2.0), 5, history)
    with pytest.raises(DivergenceError, match=r"gradient norm 30000.0\), over 10000× the median"):
        check_finite(torch.tensor(0.5), torch.tensor(30000.0), 5, history)
    check_finite(torch.tensor(8000.0), torch.tensor(30000.0), 1)  # without a history only NaN and inf stop


@pytest.mark.slow
def test_a_learning_rate_far_too_high_stops_at_its_explosion_and_names_no_diverged_checkpoint(
    script, workspace, tmp_path
):
    out = tmp_path / "out"
    argv = [*train_args(workspace, out), "--learning_rate", "1e2", "--lr_scheduler", "constant"]
    message = stop_message(script, [*argv, "--max_train_steps", "8", "--checkpointing_steps", "1",
                                    "--checkpoints_total_limit", "1"])  # fmt: skip
    step = int(message.split(" at step ")[1].split()[0])
    assert step <= 3 and ("over 10000× the median" in message or "is nan" in message or "is inf" in message), message
    named = [p for p in out.glob("checkpoint-*") if f"{p} " in message or f"{p}:" in message]
    assert all(int(p.name.split("-")[1]) < step - 1 for p in named), message


def test_weights_are_checked_before_a_checkpoint_is_written(script, tmp_path):
    model = torch.nn.Linear(2, 2)
    assert non_finite_parameters(model) == []
    with torch.no_grad():
        model.bias[0] = math.inf
    assert non_finite_parameters(model) == ["bias"]
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "optimizer.bin").write_bytes(b"state")
    write_checksums(tmp_path / "checkpoint-2")
    with pytest.raises(SystemExit) as stopped:
        require_finite_weights(model, None, 3, tmp_path, 1e-3)
    assert "after step 3, 1 weight tensor(s) hold NaN or inf (bias), so nothing was saved" in stopped.value.code
    assert f"the newest intact checkpoint is {tmp_path / 'checkpoint-2'}" in stopped.value.code
