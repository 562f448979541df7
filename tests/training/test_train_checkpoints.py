"""Checkpoints survive kills, full disks, damage, resumes from older ones and a second run on the folder."""

import errno
import fcntl
import json
import shutil
import sys
import time
from pathlib import Path
from unittest.mock import Mock

import accelerate.accelerator
import pytest
import torch
from accelerate import PartialState
from processes import run_bounded
from space_server import free_port
from test_train_text_to_image import ENV, SCRIPT, assert_same_weights, train, train_args, train_here, weights

from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.durable import write_checksums
from diffusers_lmlp.training.checkpoints import checkpoint_to_resume


STEPS = ["--max_train_steps", "6", "--checkpointing_steps", "2", "--use_ema", "--cache_features"]

# The script, SIGKILLed when accelerate starts writing the state of the checkpoint of step argv[1] (after its models).
KILL_DURING_WRITE = """
import os, runpy, signal, sys
import accelerate.accelerator as accelerator

kill_at, save = f".checkpoint-{sys.argv.pop(1)}.", accelerator.save_accelerator_state
accelerator.save_accelerator_state = lambda output_dir, *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL) if (
    os.path.basename(output_dir).startswith(kill_at)) else save(output_dir, *args, **kwargs)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if "checkpoint" in p.name)


@pytest.fixture(scope="session")  # as the workspace it writes in: a second set-up would find its run
def straight(workspace) -> Path:
    """An uninterrupted 6-step run with checkpoints at steps 2, 4 and 6: the reference of every resume."""
    train_here(workspace, "straight", *STEPS)
    return workspace / "straight"


@pytest.mark.slow
def test_sigkill_while_writing_the_only_checkpoint_keeps_the_previous_one(workspace, straight):
    out, steps = workspace / "killed-limit-1", [*STEPS, "--checkpoints_total_limit", "1"]
    killed = train(workspace, out.name, *steps, launcher=("-c", KILL_DURING_WRITE, "4"), check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert checkpoints(out) == [".checkpoint-4.tmp", "checkpoint-2"]  # killed half-way through writing checkpoint-4
    assert (out / ".train.lock").is_file()  # the file stays; its lock went with the process
    resumed = train_here(workspace, out.name, *steps, "--resume_from_checkpoint", "latest")
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in resumed.stderr
    assert "removed .checkpoint-4.tmp" in resumed.stderr
    assert checkpoints(out) == ["checkpoint-6"]
    assert_same_weights(weights(out), weights(straight))
    assert_same_weights(weights(out / "checkpoint-6"), weights(straight / "checkpoint-6"))


@pytest.mark.slow
def test_a_resume_restores_a_half_done_replacement_and_overwrites_an_abandoned_future(workspace, straight):
    # Killed between the two renames of a replacement: checkpoint-6 is set aside, the new one not yet in place.
    out = shutil.copytree(straight, workspace / "set-aside")
    (out / "checkpoint-6").rename(out / ".checkpoint-6.old")
    for name in (".checkpoint-6.tmp", ".checkpoint-7.tmp", ".checkpoint-3.deleting"):
        (out / name / "transformer").mkdir(parents=True)
        (out / name / "transformer" / "config.json").write_text("{truncated")
    result = train_here(workspace, out.name, *STEPS, "--resume_from_checkpoint", "latest")
    assert f"resumed from {out / 'checkpoint-6'} at step 6" in result.stderr
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    for stale in ("checkpoint-4", "checkpoint-6"):  # an abandoned future: other weights under the same names
        shutil.rmtree(out / stale)
        shutil.copytree(straight / "checkpoint-2", out / stale)
    steps = [*STEPS[2:], "--max_train_steps", "4", "--checkpoints_total_limit", "2"]
    result = train_here(workspace, out.name, *steps, "--resume_from_checkpoint", str(out / "checkpoint-2"))
    assert "later checkpoints checkpoint-4, checkpoint-6 of a run it abandons" in result.stderr
    # checkpoint-4 is overwritten; the abandoned checkpoint-6 is pruned before the older checkpoint-2.
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4"]
    assert_same_weights(weights(out / "checkpoint-4"), weights(straight / "checkpoint-4"))


@pytest.mark.slow
def test_a_full_disk_or_file_size_limit_names_the_folder_and_keeps_the_earlier_checkpoints(workspace, monkeypatch):
    out, args = workspace / "full-disk", [*STEPS, "--checkpoints_total_limit", "1"]
    save = accelerate.accelerator.save_accelerator_state

    def save_accelerator_state(output_dir, *args, **kwargs):
        if "checkpoint-4" in Path(output_dir).name:  # the model is written; the optimizer state does not fit
            (Path(output_dir) / "optimizer.bin").write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(output_dir) / "optimizer.bin"))
        return save(output_dir, *args, **kwargs)

    monkeypatch.setattr(accelerate.accelerator, "save_accelerator_state", save_accelerator_state)
    with pytest.raises(SystemExit, match="no space left on the device") as error:
        train_here(workspace, out, *args)
    assert f"while saving checkpoint-4 in --output_dir {out}" in str(error.value)
    assert "partial checkpoint was removed, and the earlier checkpoints are intact: checkpoint-2" in str(error.value)
    assert checkpoints(out) == ["checkpoint-2"]
    monkeypatch.undo()  # space was freed: the resume trains on, to a write past `ulimit -f` (Python ignores SIGXFSZ)
    too_large = OSError(errno.EFBIG, "File too large", str(out / "transformer/diffusion_pytorch_model.safetensors"))
    monkeypatch.setattr(LMLPPipeline, "save_pretrained", Mock(side_effect=too_large))
    with pytest.raises(SystemExit, match=r"\(or a file-size limit, `ulimit -f`\) while saving the pipeline") as error:
        train_here(workspace, out, *args, "--resume_from_checkpoint", "latest")
    assert "The pipeline is saved in part, and the earlier checkpoints are intact: checkpoint-6" in str(error.value)
    assert checkpoints(out) == ["checkpoint-6"]


def zero_sector(path: Path) -> None:
    """Zero 4 KiB at 60% of the file, as a failing disk sector would."""
    with open(path, "r+b") as f:
        f.seek(int(path.stat().st_size * 0.6))
        f.write(bytes(4096))


@pytest.mark.slow
def test_latest_passes_over_a_damaged_checkpoint_and_resumes_exactly_from_the_one_before(workspace, straight):
    out = shutil.copytree(straight, workspace / "damaged")
    shutil.rmtree(out / "checkpoint-6")
    zero_sector(out / "checkpoint-4" / "transformer" / "diffusion_pytorch_model.safetensors")
    result = train_here(workspace, out.name, *STEPS, "--resume_from_checkpoint", "latest")
    assert "checkpoint-4 is damaged (transformer/diffusion_pytorch_model.safetensors differs from" in result.stderr
    assert "--resume_from_checkpoint latest takes an earlier one" in result.stderr
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in result.stderr
    assert_same_weights(weights(out), weights(straight))


DAMAGES = [
    ("optimizer.bin is missing", lambda c: (c / "optimizer.bin").unlink()),
    ("transformer_ema/diffusion_pytorch_model.safetensors differs from its checksum \\(damaged or edited\\)",
     lambda c: zero_sector(c / "transformer_ema" / "diffusion_pytorch_model.safetensors")),
    ("training_state.json differs from its checksum", lambda c: (c / "training_state.json").write_text("{")),
    ("extra.txt was added after it was written", lambda c: (c / "extra.txt").write_text("x")),
    ("it has no checksums.json", lambda c: (c / "checksums.json").unlink()),
    *[("its checksums.json is not a list of checksums", lambda c, text=text: (c / "checksums.json").write_text(text))
      for text in ("{}", '{"sha256": {}}', '{"sha256": [1]}', '{"sha256": null}', "[", '{"sha256": {"a.bin": 1}}')],
]  # fmt: skip


@pytest.mark.parametrize("problem, damage", DAMAGES)
def test_a_damaged_checkpoint_named_explicitly_or_as_the_only_one_stops_the_run(straight, tmp_path, problem, damage):
    checkpoint = shutil.copytree(straight / "checkpoint-4", tmp_path / "checkpoint-4")
    damage(checkpoint)
    PartialState(cpu=True)  # for the warning `latest` logs about each damaged checkpoint
    with pytest.raises(SystemExit, match=f"the checkpoint {checkpoint} is damaged: {problem}"):
        checkpoint_to_resume(tmp_path, str(checkpoint))
    with pytest.raises(SystemExit, match=r"no checkpoint in .* is intact \(checkpoint-4 are damaged"):
        checkpoint_to_resume(tmp_path, "latest")


@pytest.mark.slow
def test_a_run_killed_before_its_card_leaves_none_and_overwriting_drops_checkpoints(workspace, straight, monkeypatch):
    out = shutil.copytree(straight, workspace / "continued")
    assert "diffusers-lmlp:description" in (out / "README.md").read_text()
    # Killed after the new weights are saved, before the card is written.
    monkeypatch.setattr("diffusers_lmlp.training.finishing.write_model_card", Mock(side_effect=KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        train_here(workspace, out.name, *STEPS[2:], "--max_train_steps", "8", "--resume_from_checkpoint", "latest")
    assert not (out / "training_summary.json").exists()  # not a finished run: nothing describes 6 steps any more
    assert "diffusers-lmlp:description" not in (out / "README.md").read_text()
    assert any(not torch.equal(a, b) for a, b in zip(weights(out).values(), weights(straight).values()))
    monkeypatch.undo()  # overwritten, the run's checkpoints go, so that none is resumed later
    result = train_here(workspace, out.name, *STEPS[2:], "--max_train_steps", "2", "--overwrite_output_dir")
    assert "removed the earlier run's checkpoint-2, checkpoint-4, checkpoint-6, checkpoint-8" in result.stderr
    assert checkpoints(out) == ["checkpoint-2"]
    assert json.loads((out / "training_summary.json").read_text())["steps"] == 2


@pytest.mark.slow
def test_a_second_run_on_a_busy_output_dir_is_refused_by_every_process(workspace, capsys):
    (busy := workspace / "busy").mkdir()
    refusal = f"another training run is using --output_dir {busy}"
    with open(busy / ".train.lock", "a+") as lock:  # taken by this process, as the other run's would be
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit) as refused:
            train_here(workspace, busy.name, "--max_train_steps", "1")
        assert f"{refusal}: wait for it, or pass another" in str(refused.value) + capsys.readouterr().err
        launch = "-m accelerate.commands.launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no"
        launch = [sys.executable, *launch.split(), "--dynamo_backend", "no", "--main_process_port", str(free_port())]
        launch += [str(SCRIPT), *train_args(workspace, busy.name), "--train_batch_size", "2", "--max_train_steps", "1"]
        result = run_bounded(launch, env={**ENV, "ACCELERATE_USE_CPU": "1"}, timeout=120)
    assert result.returncode != 0 and result.stderr.count(refusal) == 2  # both ranks say why
    assert checkpoints(busy) == [] and not (busy / "model_index.json").exists()


@pytest.mark.slow
def test_a_resume_adds_up_the_training_time_and_trains_at_the_learning_rate_given_now(workspace, straight):
    out = workspace / "time"
    shutil.copytree(straight / "checkpoint-4", out / "checkpoint-4")
    state = json.loads((straight / "checkpoint-4" / "training_state.json").read_text())
    assert 0 < state["train_seconds"] <= json.loads((straight / "training_summary.json").read_text())["train_seconds"]
    # The first segment took 1000 s, say (and wrote its checksums): the resumed run's summary includes them.
    (out / "checkpoint-4" / "training_state.json").write_text(json.dumps({**state, "train_seconds": 1000.0}))
    write_checksums(out / "checkpoint-4")
    start = time.monotonic()
    result = train_here(workspace, out.name, *STEPS, "--resume_from_checkpoint", "latest", "--learning_rate", "3e-05")
    elapsed = time.monotonic() - start
    assert "resuming at --learning_rate 3e-05; the checkpoint's run trained at 0.001" in result.stderr
    now, before = weights(out / "checkpoint-6"), weights(straight / "checkpoint-6")
    assert any(not torch.equal(now[key], before[key]) for key in before)
    summary = json.loads((out / "training_summary.json").read_text())
    assert 1000.0 <= summary["train_seconds"] < 1000.0 + elapsed  # rounded to 0.1 s
    saved = json.loads((out / "checkpoint-6" / "training_state.json").read_text())["train_seconds"]
    # The last checkpoint is written just before the loop ends: its time is the summary's, up to a busy second.
    assert 1000.0 < saved < 1000.0 + elapsed and saved == pytest.approx(summary["train_seconds"], abs=1.0)
