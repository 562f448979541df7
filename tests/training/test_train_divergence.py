"""A NaN, inf or exploded loss or gradient norm stops the run before that step is applied, keeping good checkpoints."""

import collections
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train_text_to_image import train_args
from test_train_validation import start_up_error

from diffusers_lmlp.durable import write_checksums
from diffusers_lmlp.training.checkpoints import require_finite_weights
from diffusers_lmlp.training.step import EXPLOSION_WINDOW, DivergenceError, check_finite, non_finite_parameters


def all_finite(folder: Path) -> bool:
    return all(torch.isfinite(t).all() for f in folder.rglob("*.safetensors") for t in load_file(f).values())


@pytest.mark.parametrize(
    "learning_rate, extra",
    [("1e9", ["--max_train_steps", "20", "--adam_epsilon", "1e-30"]),
     pytest.param("1e2", ["--max_train_steps", "8", "--lr_scheduler", "constant", "--checkpoints_total_limit", "1"],
                  marks=pytest.mark.slow)],
    ids=["diverges", "explodes"],
)  # fmt: skip
def test_a_learning_rate_far_too_high_stops_the_run_writing_no_nan(script, workspace, tmp_path, learning_rate, extra):
    out = tmp_path / "out"
    argv = [*train_args(workspace, out), "--learning_rate", learning_rate, "--checkpointing_steps", "1", *extra]
    message = start_up_error(script, argv)
    assert any(word in message for word in ("is nan", "is inf", "hold NaN or inf", "over 10000× the median")), message
    assert f"a lower --learning_rate (now {float(learning_rate):g})" in message
    assert all(all_finite(checkpoint) for checkpoint in out.glob("checkpoint-*"))
    assert not (out / "model_index.json").exists()
    if learning_rate == "1e2":  # stopped at its explosion, naming no checkpoint of the diverged steps
        step = int(message.split(" at step ")[1].split()[0])
        named = [p for p in out.glob("checkpoint-*") if f"{p} " in message or f"{p}:" in message]
        assert step <= 3 and all(int(p.name.split("-")[1]) < step - 1 for p in named), message


def test_check_finite_refuses_nan_inf_and_a_finite_explosion_against_the_steps_before():
    check_finite(torch.tensor(0.5), torch.tensor(1.0), step=3)
    for loss, norm in ((math.nan, 1.0), (math.inf, 1.0), (0.5, math.nan), (0.5, math.inf)):
        with pytest.raises(DivergenceError, match=r"at step 7 \(gradient norm"):
            check_finite(torch.tensor(loss), torch.tensor(norm), step=7)
    history = collections.deque(maxlen=EXPLOSION_WINDOW)
    for step in (1, 2, 3):
        check_finite(torch.tensor(0.5), torch.tensor(2.0), step, history)
    check_finite(torch.tensor(4000.0), torch.tensor(2.0), 4, history)  # 8000× the median: within the bound
    with pytest.raises(DivergenceError, match=r"loss is 8000.0 at step 5 .*over 10000× the median of the last 4"):
        check_finite(torch.tensor(8000.0), torch.tensor(2.0), 5, history)
    with pytest.raises(DivergenceError, match=r"gradient norm 30000.0\), over 10000× the median"):
        check_finite(torch.tensor(0.5), torch.tensor(30000.0), 5, history)
    check_finite(torch.tensor(8000.0), torch.tensor(30000.0), 1)  # without a history only NaN and inf stop


def test_weights_are_checked_before_a_checkpoint_is_written(tmp_path):
    model = torch.nn.Linear(2, 2)
    assert non_finite_parameters(model) == []
    with torch.no_grad():
        model.bias[0] = math.inf
    assert non_finite_parameters(model) == ["bias"]
    (good := tmp_path / "checkpoint-2").mkdir()
    (good / "optimizer.bin").write_bytes(b"state")
    write_checksums(good)
    with pytest.raises(
        SystemExit, match=r"after step 3, 1 weight tensor\(s\) hold NaN or inf \(bias\), so nothing was"
    ) as e:
        require_finite_weights(model, None, 3, tmp_path, 1e-3)
    assert f"the newest intact checkpoint is {good}" in e.value.code
