"""The trainer's checkpoints survive kills, full disks, damage, resumes from older ones and a second run on the folder."""

import errno
import fcntl
import json
import shutil
import sys
import time
from pathlib import Path

import accelerate.accelerator
import pytest
import torch
from accelerate import PartialState
from processes import run_bounded
from test_train_text_to_image import (
    ENV,
    SCRIPT,
    assert_same_weights,
    free_port,
    train,
    train_args,
    train_here,
    weights,
)

from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.durable import checksum_problem, write_checksums
from diffusers_lmlp.training.checkpoints import checkpoint_to_resume


STEPS = ["--max_train_steps", "6", "--checkpointing_steps", "2", "--use_ema", "--cache_features"]

# The script, SIGKILLed when accelerate starts writing the state of the checkpoint of step argv[1] (after its models).
KILL_DURING_WRITE = """
import os, runpy, signal, sys
import accelerate.accelerator

kill_at, save = f"checkpoint-{sys.argv.pop(1)}", accelerate.accelerator.save_accelerator_state


def save_accelerator_state(output_dir, *args, **kwargs):
    if os.path.basename(output_dir).startswith(f".{kill_at}."):
        os.kill(os.getpid(), signal.SIGKILL)
    return save(output_dir, *args, **kwargs)


accelerate.accelerator.save_accelerator_state = save_accelerator_state
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="session")  # as the workspace it writes in: a second set-up would find its run
def straight(workspace) -> Path:
    """An uninterrupted 6-step run with checkpoints at steps 2, 4 and 6: the reference of every resume."""
    train_here(workspace, "straight", *STEPS)
    return workspace / "straight"


@pytest.mark.slow
def test_sigkill_while_writing_the_only_checkpoint_keeps_the_previous_one(workspace, straight):
    out = workspace / "killed-limit-1"
    killed = train(
        workspace, out.name, *STEPS, "--checkpoints_total_limit", "1", launcher=("-c", KILL_DURING_WRITE, "4"),
        check=False
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (out / ".checkpoint-4.tmp" / "transformer").is_dir()  # killed half-way through the write
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert (out / ".train.lock").is_file()  # the file stays; its lock went with the process

    resumed = train_here(workspace, out.name, *STEPS, "--checkpoints_total_limit", "1", "--resume_from_checkpoint", "latest")  # fmt: skip
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in resumed.stderr
    assert "removed .checkpoint-4.tmp" in resumed.stderr
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-6"]
    assert_same_weights(weights(out), weights(straight))
    assert_same_weights(weights(out / "checkpoint-6"), weights(straight / "checkpoint-6"))


@pytest.mark.slow
def test_a_resume_from_an_older_checkpoint_overwrites_the_abandoned_later_ones_and_prunes_them_first(
    workspace, straight
):
    out = workspace / "older"
    shutil.copytree(straight, out)
    for stale in ("checkpoint-4", "checkpoint-6"):  # an abandoned future: other weights under the same names
        shutil.rmtree(out / stale)
        shutil.copytree(straight / "checkpoint-2", out / stale)
    steps = [*STEPS[2:], "--max_train_steps", "4", "--checkpoints_total_limit", "2"]
    result = train_here(workspace, out.name, *steps, "--resume_from_checkpoint", str(out / "checkpoint-2"))
    assert "later checkpoints checkpoint-4, checkpoint-6 of a run it abandons" in result.stderr
    # checkpoint-4 is overwritten; the abandoned checkpoint-6 is pruned before the older checkpoint-2.
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-2", "checkpoint-4"]
    assert_same_weights(weights(out / "checkpoint-4"), weights(straight / "checkpoint-4"))


@pytest.mark.slow
def test_what_an_interrupted_run_left_half_done_is_restored_or_removed_at_start_up(workspace, straight):
    # Killed between the two renames of a replacement: checkpoint-6 is set aside, the new one not yet in place.
    out = workspace / "set-aside"
    shutil.copytree(straight, out)
    (out / "checkpoint-6").rename(out / ".checkpoint-6.old")
    for name in (".checkpoint-6.tmp", ".checkpoint-7.tmp", ".checkpoint-3.deleting"):
        (out / name / "transformer").mkdir(parents=True)
        (out / name / "transformer" / "config.json").write_text("{truncated")
    result = train_here(workspace, out.name, *STEPS, "--resume_from_checkpoint", "latest")
    assert f"resumed from {out / 'checkpoint-6'} at step 6" in result.stderr
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == [f"checkpoint-{s}" for s in (2, 4, 6)]


@pytest.mark.slow
def test_a_full_disk_names_the_folder_and_keeps_the_previous_checkpoint(workspace, monkeypatch):
    out = workspace / "full-disk"
    save = accelerate.accelerator.save_accelerator_state

    def save_accelerator_state(output_dir, *args, **kwargs):
        if "checkpoint-4" in Path(output_dir).name:  # the model is written; the optimizer state does not fit
            (Path(output_dir) / "optimizer.bin").write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(output_dir) / "optimizer.bin"))
        return save(output_dir, *args, **kwargs)

    monkeypatch.setattr(accelerate.accelerator, "save_accelerator_state", save_accelerator_state)
    args = [*STEPS, "--checkpoints_total_limit", "1"]
    with pytest.raises(SystemExit) as error:
        train_here(workspace, out, *args)
    message = str(error.value)
    assert "no space left on the device" in message and str(out) in message and "checkpoint-4" in message
    assert "the earlier checkpoints are intact: checkpoint-2" in message
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-2"]

    monkeypatch.setattr(accelerate.accelerator, "save_accelerator_state", save)  # space was freed: resume
    train_here(workspace, out, *args, "--resume_from_checkpoint", "latest")
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-6"]


def zero_sector(path: Path, at: float = 0.6) -> None:
    """Zero 4 KiB at `at` of the file, as a failing disk sector would."""
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    data[start : start + 4096] = bytes(len(data[start : start + 4096]))
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_latest_passes_over_a_damaged_checkpoint_and_resumes_exactly_from_the_one_before(workspace, straight):
    out = workspace / "damaged"
    shutil.copytree(straight, out)
    shutil.rmtree(out / "checkpoint-6")
    zero_sector(out / "checkpoint-4" / "transformer" / "diffusion_pytorch_model.safetensors")
    result = train_here(workspace, out.name, *STEPS, "--resume_from_checkpoint", "latest")
    assert (
        "checkpoint-4 is damaged (transformer/diffusion_pytorch_model.safetensors differs from its checksum (damaged "
        "or edited)): --resume_from_checkpoint latest takes an earlier one"
    ) in result.stderr
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in result.stderr
    assert_same_weights(weights(out), weights(straight))


DAMAGES = {
    "optimizer.bin is missing": lambda c: (c / "optimizer.bin").unlink(),
    "transformer_ema/diffusion_pytorch_model": lambda c: zero_sector(c / "transformer_ema" / "diffusion_pytorch_model.safetensors"),
    "training_state.json differs from its checksum": lambda c: (c / "training_state.json").write_text("{"),
    "it has no checksums.json": lambda c: (c / "checksums.json").unlink(),
}  # fmt: skip


@pytest.mark.parametrize("problem", DAMAGES)
def test_a_damaged_checkpoint_named_explicitly_or_as_the_only_one_stops_the_run(straight, tmp_path, problem):
    checkpoint = tmp_path / "checkpoint-4"
    shutil.copytree(straight / "checkpoint-4", checkpoint)
    DAMAGES[problem](checkpoint)
    PartialState(cpu=True)  # for the warning `latest` logs about each damaged checkpoint
    with pytest.raises(SystemExit, match=f"the checkpoint {checkpoint} is damaged: {problem}"):
        checkpoint_to_resume(tmp_path, str(checkpoint))
    with pytest.raises(SystemExit, match=r"no checkpoint in .* is intact \(checkpoint-4 are damaged"):
        checkpoint_to_resume(tmp_path, "latest")


def test_checksums_show_a_changed_missing_or_added_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "weights.bin").write_bytes(b"0123")
    write_checksums(tmp_path)
    assert checksum_problem(tmp_path) is None
    (tmp_path / "a" / "weights.bin").write_bytes(b"0124")
    assert checksum_problem(tmp_path) == "a/weights.bin differs from its checksum (damaged or edited)"
    (tmp_path / "extra.txt").write_text("x")
    assert checksum_problem(tmp_path) == "extra.txt was added after it was written"
    for text in (
        "{}",
        '{"sha256": {}}',
        '{"sha256": [1]}',
        '{"sha256": null}',
        "[",
        '{"sha256": {"a/weights.bin": 1}}',
    ):
        (tmp_path / "checksums.json").write_text(text)
        assert checksum_problem(tmp_path) == "its checksums.json is not a list of checksums", text


@pytest.mark.slow
def test_a_file_size_limit_during_the_final_save_stops_with_the_disk_full_message(workspace, monkeypatch):
    out = workspace / "file-size-limit"

    def too_large(self, *args, **kwargs):  # what a write past `ulimit -f` raises (Python ignores SIGXFSZ)
        raise OSError(errno.EFBIG, "File too large", str(out / "transformer" / "diffusion_pytorch_model.safetensors"))

    monkeypatch.setattr(LMLPPipeline, "save_pretrained", too_large)
    with pytest.raises(SystemExit) as error:
        train_here(workspace, out, *STEPS[2:], "--max_train_steps", "2")
    message = str(error.value)
    assert "no space left on the device (or a file-size limit, `ulimit -f`) while saving the pipeline" in message
    assert "The pipeline is saved in part, and the earlier checkpoints are intact: checkpoint-2" in message


@pytest.mark.slow
def test_a_continued_run_killed_before_its_card_leaves_no_summary_or_card_of_the_earlier_weights(
    workspace, straight, monkeypatch
):
    out = workspace / "continued"
    shutil.copytree(straight, out)
    assert "diffusers-lmlp:description" in (out / "README.md").read_text()

    def killed(*args, **kwargs):  # as a SIGKILL after the new weights are saved, before the card is written
        raise KeyboardInterrupt

    monkeypatch.setattr("diffusers_lmlp.training.finishing.write_model_card", killed)
    with pytest.raises(KeyboardInterrupt):
        train_here(workspace, out.name, *STEPS[2:], "--max_train_steps", "8", "--resume_from_checkpoint", "latest")
    assert not (out / "training_summary.json").exists()  # not a finished run: nothing describes 6 steps any more
    assert "diffusers-lmlp:description" not in (out / "README.md").read_text()
    assert any(not torch.equal(a, b) for a, b in zip(weights(out).values(), weights(straight).values()))


@pytest.mark.slow
def test_overwriting_a_run_removes_its_checkpoints_so_that_none_is_resumed_later(workspace, straight):
    out = workspace / "overwritten"
    shutil.copytree(straight, out)
    result = train_here(workspace, out.name, *STEPS[2:], "--max_train_steps", "2", "--overwrite_output_dir")
    assert "--overwrite_output_dir: removed the earlier run's checkpoint-2, checkpoint-4, checkpoint-6" in result.stderr  # fmt: skip
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert json.loads((out / "training_summary.json").read_text())["steps"] == 2


@pytest.mark.slow
def test_a_second_run_on_a_busy_output_dir_is_refused_by_every_process(workspace, capsys):
    busy = workspace / "busy"
    busy.mkdir()
    with open(busy / ".train.lock", "a+") as lock:  # taken by this process, as the other run's would be
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit) as refused:
            train_here(workspace, busy.name, "--max_train_steps", "1")
        message = str(refused.value) + capsys.readouterr().err
        assert f"another training run is using --output_dir {busy}: wait for it, or pass another" in message
        launch = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), str(SCRIPT), *train_args(workspace, busy.name),
            "--train_batch_size", "2", "--max_train_steps", "1"
        ]  # fmt: skip
        result = run_bounded(launch, env={**ENV, "ACCELERATE_USE_CPU": "1"}, timeout=120)
    assert result.returncode != 0
    assert result.stderr.count(f"another training run is using --output_dir {busy}") == 2  # both ranks say why
    assert not list(busy.glob("*checkpoint-*")) and not (busy / "model_index.json").exists()


@pytest.mark.slow
def test_a_resume_adds_up_the_training_time_and_trains_at_the_learning_rate_given_now(workspace, straight):
    out = workspace / "time"
    shutil.copytree(straight / "checkpoint-4", out / "checkpoint-4")
    state = json.loads((straight / "checkpoint-4" / "training_state.json").read_text())
    first = json.loads((straight / "training_summary.json").read_text())["train_seconds"]
    assert 0 < state["train_seconds"] <= first  # the time up to step 4, inside the checkpoint
    # Pretend the first segment took 1000 s: the resumed run's summary includes it.
    (out / "checkpoint-4" / "training_state.json").write_text(json.dumps({**state, "train_seconds": 1000.0}))
    write_checksums(out / "checkpoint-4")  # as the run that took 1000 s would have written them

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
