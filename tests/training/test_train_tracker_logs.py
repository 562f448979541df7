"""What the trackers get from a training run (`--logging_steps`): the mean loss and gradient norm of each window of
steps at its last step, the learning rate of that step; the steps of an unfinished window at the run's last step and
when a diverging loss stops the run early; never a NaN, and never a finished step left out."""

import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_train_divergence import nan_loss_from_step
from test_train_text_to_image import load_script, make_workspace, train_args

from diffusers_lmlp.training import trainer
from diffusers_lmlp.training.arguments import PRESETS, build_parser, parse_args
from diffusers_lmlp.training.trainer import TrackerLogs


class RecordingAccelerator:
    """Stands in for the accelerator: records each `log` call."""

    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log(self, values: dict, step: int) -> None:
        self.logged.append((step, dict(values)))


def test_each_window_sends_its_means_at_its_last_step_and_the_rest_when_sent():
    accelerator = RecordingAccelerator()
    logs = TrackerLogs(accelerator, every=3)
    for step in range(1, 8):
        logs.add(step, loss=float(step), grad_norm=10.0 * step, lr=0.1 / step)
    assert accelerator.logged == [
        (3, {"loss": 2.0, "lr": 0.1 / 3, "grad_norm": 20.0}),
        (6, {"loss": 5.0, "lr": 0.1 / 6, "grad_norm": 50.0}),
    ]
    logs.send()  # the run ends, or stops, after step 7
    assert accelerator.logged[-1] == (7, {"loss": 7.0, "lr": 0.1 / 7, "grad_norm": 70.0})
    logs.send()  # nothing gathered since: nothing sent twice
    assert len(accelerator.logged) == 3


def test_every_step_is_its_own_log_with_logging_steps_1():
    accelerator = RecordingAccelerator()
    logs = TrackerLogs(accelerator, every=1)
    for step, loss in enumerate([0.5, 0.25, 0.125], start=1):
        logs.add(step, loss=loss, grad_norm=1.0, lr=1e-4)
    assert accelerator.logged == [
        (s, {"loss": v, "lr": 1e-4, "grad_norm": 1.0}) for s, v in [(1, 0.5), (2, 0.25), (3, 0.125)]
    ]


def test_the_shapes_presets_log_every_10_steps_other_runs_every_step_and_the_option_is_checked(capsys):
    assert parse_args(["--output_dir", "o"]).logging_steps == 10
    assert parse_args(["--output_dir", "o", "--lora_rank", "4"]).logging_steps == 10  # shapes-lora
    assert parse_args(["--output_dir", "o", "--logging_steps", "1"]).logging_steps == 1
    # Your data, or the COCO recipe: diffusers' train_text_to_image logs every step, and so does this trainer.
    assert build_parser().get_default("logging_steps") == 1 and PRESETS["coco-f2"].logging_steps == 1
    with pytest.raises(SystemExit):
        parse_args(["--output_dir", "o", "--logging_steps", "0"])
    assert "argument --logging_steps: must be >= 1, got 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("tracker-logs"))


def step_losses(monkeypatch) -> list[float]:
    """Each optimizer step's loss as the step returns it, recorded where the trainer calls the step."""
    losses, take_step = [], trainer.training_step

    def recorded(*args, **kwargs):
        result = take_step(*args, **kwargs)
        losses.append(result.loss.item())
        return result

    monkeypatch.setattr(trainer, "training_step", recorded)
    return losses


def logged_losses(output_dir) -> list[tuple[int, float]]:
    events = EventAccumulator(str(output_dir / "logs" / "lmlp-text-to-image")).Reload()
    return [(event.step, event.value) for event in events.Scalars("loss")]


@pytest.mark.slow
def test_tensorboard_gets_each_windows_mean_loss_and_the_last_partial_window(workspace, tmp_path, monkeypatch):
    losses = step_losses(monkeypatch)
    out = tmp_path / "out"
    argv = [*train_args(workspace, out), "--max_train_steps", "7", "--checkpointing_steps", "7"]
    load_script().main([*argv, "--report_to", "tensorboard", "--logging_steps", "3"])
    assert len(losses) == 7
    expected = [(3, sum(losses[:3]) / 3), (6, sum(losses[3:6]) / 3), (7, losses[6])]
    logged = logged_losses(out)
    assert [step for step, _ in logged] == [step for step, _ in expected]
    for (_, value), (_, mean) in zip(logged, expected):
        assert value == pytest.approx(mean, rel=1e-6)


@pytest.mark.slow
def test_a_diverging_run_logs_its_finished_steps_and_never_the_nan(workspace, tmp_path, monkeypatch):
    losses = step_losses(monkeypatch)
    nan_loss_from_step(monkeypatch, 5)
    out = tmp_path / "out"
    argv = [*train_args(workspace, out), "--max_train_steps", "8", "--checkpointing_steps", "8"]
    with pytest.raises(SystemExit, match="the loss is nan at step 5"):
        load_script().main([*argv, "--report_to", "tensorboard", "--logging_steps", "3"])
    assert len(losses) == 4  # steps 1-4 finished; step 5 raised
    logged = logged_losses(out)
    assert [step for step, _ in logged] == [3, 4]  # step 4, of the unfinished window, sent when the run stopped
    assert logged[1][1] == pytest.approx(losses[3], rel=1e-6)
    assert all(math.isfinite(value) for _, value in logged)
