"""examples/train_text_to_image.py on a tiny pipeline and imagefolder, as a subprocess or in this process (`main`);
its checkpoints survive kills, full disks, damage, resumes from older ones and a second run on the folder; a NaN, inf
or huge loss or gradient norm stops the run before that step, keeping good checkpoints and logging no NaN."""

import collections
import contextlib
import errno
import fcntl
import io
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import Mock, call

import accelerate.accelerator
import huggingface_hub
import numpy as np
import pytest
import torch
from accelerate import PartialState
from PIL import Image
from processes import run_bounded
from safetensors.torch import load_file
from space_server import free_port
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import diffusers_lmlp.hub
import diffusers_lmlp.train
from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.durable import write_checksums
from diffusers_lmlp.tiny import build_tiny_pipeline
from diffusers_lmlp.training import finishing, trainer
from diffusers_lmlp.training import step as step_module
from diffusers_lmlp.training.checkpoints import checkpoint_to_resume, require_finite_weights
from diffusers_lmlp.training.step import EXPLOSION_WINDOW, DivergenceError, check_finite, non_finite_parameters


SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_text_to_image.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def make_workspace(root: Path) -> Path:
    """A tiny saved pipeline (16 px images) and an imagefolder of 24 images with caption lists (one has two)."""
    for family, name in (("lmlp", "tiny"), ("moe_mlp", "tiny-moe"), ("asymmixer", "tiny-asym")):
        build_tiny_pipeline(family).save_pretrained(root / name)
    (data := root / "data").mkdir()
    rng = np.random.default_rng(0)
    with open(data / "metadata.jsonl", "w") as f:
        for i in range(24):
            Image.fromarray(rng.integers(0, 255, (20, 18, 3), dtype=np.uint8)).save(data / f"{i}.png")
            text = ["a red circle", "a blue square"] if i == 0 else [["a red circle", "a blue square"][i % 2]]
            f.write(json.dumps({"file_name": f"{i}.png", "text": text}) + "\n")
    return root


def train(workspace: Path, output: str, *extra: str, base: str = "tiny", check: bool = True, launcher=(), env=None):
    """Run the script on the tiny pipeline and imagefolder; `launcher` goes between python and the script."""
    args = [sys.executable, *launcher, str(SCRIPT), *train_args(workspace, output, base), *extra]
    result = subprocess.run(args, env=env or ENV, capture_output=True, text=True, timeout=600)
    if check and result.returncode:
        raise AssertionError(f"training failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


def train_here(workspace, output, *extra, base="tiny", data_option="--train_data_dir") -> SimpleNamespace:
    """`train`'s run in this process, on one thread; returns its `stdout` and `stderr` (with the INFO records)."""
    threads, root, stdout, stderr = torch.get_num_threads(), logging.getLogger(), io.StringIO(), io.StringIO()
    log, level = logging.StreamHandler(stderr), root.level
    log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))  # the trainer's format
    root.addHandler(log)
    root.setLevel(logging.INFO)
    argv = [*train_args(workspace, output, base, data_option), "--num_threads", "1", *extra]
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            diffusers_lmlp.train.main(argv)
    except BaseException:
        sys.stderr.write(f"{stdout.getvalue()[-2000:]}\n{stderr.getvalue()[-4000:]}")
        raise
    finally:
        root.removeHandler(log)
        root.setLevel(level)
        torch.set_num_threads(threads)
    return SimpleNamespace(stdout=stdout.getvalue(), stderr=stderr.getvalue())


def train_args(workspace, output, base="tiny", data_option="--train_data_dir", data=None) -> list[str]:
    """The tiny pipeline `base` on the imagefolder (or `data`), 16 px, batch 4, into `output` (in `workspace`)."""
    return [
        "--pretrained_model_name_or_path", str(workspace / base), data_option, str(data or workspace / "data"),
        "--resolution", "16", "--train_batch_size", "4", "--report_to", "none", "--output_dir", str(workspace / output),
        "--cache_dir", str(workspace / "cache"), "--lr_warmup_steps", "0", "--learning_rate", "1e-3"
    ]  # fmt: skip


def start_up_error(script, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as error:
        script.main(argv)
    assert isinstance(error.value.code, str), error.value.code
    return error.value.code


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:  # bit for bit
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.slow
def test_trains_and_saves_a_loadable_pipeline_with_card_and_grid(workspace, monkeypatch):
    for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):  # a user's would be kept
        monkeypatch.delenv(name, raising=False)
    base = weights(workspace / "tiny")
    result = train_here(
        workspace, "run", "--max_train_steps", "3", "--checkpointing_steps", "2", "--use_ema",
        "--validation_prompts", "a red circle", "a blue square", "--validation_steps", "2",
        "--validation_inference_steps", "2", "--pretrained_vae", str(workspace / "tiny"), "--vae_subfolder", "vae",
        "--pretrained_text_encoder", str(workspace / "tiny"), "--text_encoder_subfolder", "text_encoder",
        "--latent_scale", "0.5", "--gradient_checkpointing", "--max_grad_norm", "0.5", "--random_flip"
    )  # fmt: skip
    out = workspace / "run"
    assert "steps: 100%" in result.stderr and "loss=" in result.stderr
    assert "CPU memory: glibc keeps up to 1 GiB of freed buffers for reuse" in result.stderr
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    for part in ("transformer", "transformer_ema"):
        assert (out / "checkpoint-2" / part / "diffusion_pytorch_model.safetensors").is_file()
    assert (out / "validation" / "step-0000002.png").is_file() and (out / "samples.png").is_file()
    card = (out / "README.md").read_text()
    assert "library_name: diffusers" in card and "pipeline_tag: text-to-image" in card and "samples.png" in card
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["num_processes"] == 1 and summary["ranks_in_sync"] and summary["steps"] == 3
    # What a push publishes names no folder of this machine.
    published = [p for p in out.rglob("*.*") if p.suffix in {".json", ".md"} and p.parts[len(out.parts)] != "logs"]
    assert "3 steps on the local folder `data`" in card and len(published) > 5
    assert not [str(p) for p in published if str(workspace) in p.read_text()]
    assert json.loads((out / "vae" / "config.json").read_text())["scaling_factor"] == 0.5  # travels with the pipeline

    pipe = LMLPPipeline.from_pretrained(out)
    assert any(not torch.equal(pipe.transformer.state_dict()[k], base[k]) for k in base)  # it learned something
    assert pipe("a red circle", num_inference_steps=2, output_type="np").images.shape == (1, 16, 16, 3)


@pytest.mark.slow
def test_gradient_accumulation_matches_the_large_batch(workspace, tmp_path):
    train_here(workspace, tmp_path / "big", "--max_train_steps", "2", "--train_batch_size", "8")
    steps = ("--max_train_steps", "2", "--train_batch_size", "4", "--gradient_accumulation_steps", "2")
    train_here(workspace, tmp_path / "accum", *steps)
    big, accum, base = weights(tmp_path / "big"), weights(tmp_path / "accum"), weights(workspace / "tiny")
    assert any(not torch.equal(big[k], base[k]) for k in big)
    torch.testing.assert_close(accum, big, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("base, extra, model_class", [
    ("tiny-moe", ["--load_balance_weight", "0.01", "--snr_gamma", "5.0", "--noise_offset", "0.05", "--mixed_precision",
                  "bf16"], "MoEMLPModel"),
    ("tiny-asym", ["--symmetry_breaking_weight", "0.01"], "AsymMixerTransformer2DModel")
], ids=["moe-load-balancing-min-snr-noise-offset-bf16", "asymmixer-symmetry-breaking"])  # fmt: skip
def test_the_family_losses_train(workspace, base, extra, model_class):
    train_here(workspace, f"{base}-run", "--max_train_steps", "2", *extra, base=base)
    config = json.loads((workspace / f"{base}-run" / "transformer" / "config.json").read_text())
    assert config["_class_name"] == model_class and (workspace / f"{base}-run" / "model_index.json").is_file()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model_type", "transformer"], "argument --model_type: invalid choice: 'transformer'"),
        (["--symmetry_breaking_weight", "0.01"], "weight: LMLPTransformer2DModel has no symmetry-breaking"),
        (["--caption_column", "caption"], "--caption_column 'caption' is not a column of the dataset"),
        (["--resume_from_checkpoint", "no/such/checkpoint"], "no/such/checkpoint: no such checkpoint folder"),
        (["--model_type", "moe_mlp"], "--model_type moe_mlp conflicts with the base pipeline"),
        (["--load_balance_weight", "0.01"], "--load_balance_weight applies to MoE-MLP backbones only"),
        (["--random_flip", "--cache_features"], "--random_flip cannot be combined with --cache_features"),
        (["--resolution", "32", "--cache_features"], "--resolution 32 does not match the model: sample_size 8 × VAE "
         "factor 2 = 16 px. Token mixing is over a fixed number of tokens: pass --resolution 16 (a fine-tuned model"),
        (["--push_to_hub", "--hub_model_id", "a/b/c"], "--hub_model_id 'a/b/c' is not a valid Hub repo id"),
        (["--seed", "-1"], "argument --seed: must be >= 0 and < 4294967296 (numpy's 32-bit seeds"),
        (["--seed", str(2**32)], f"(numpy's 32-bit seeds; every draw of the run comes from it), got {2**32}"),
    ],
)  # fmt: skip
def test_bad_arguments_fail_at_start_up_with_a_clear_message(script, workspace, tmp_path, extra, message, capsys):
    args = [*train_args(workspace, "bad"), "--max_train_steps", "1", "--cache_dir", str(tmp_path), *extra]
    with pytest.raises((SystemExit, ValueError)) as stopped:
        script.main(args)
    assert message in str(stopped.value) + capsys.readouterr().err
    assert not (workspace / "bad" / "checkpoint-1").exists() and not (tmp_path / "features").exists()


@pytest.mark.slow
def test_the_hub_token_reaches_the_upload_and_nothing_else(workspace, tmp_path, monkeypatch):
    secret, url = "hf_SECRETtest0123456789abcdefghijklmnop", "https://huggingface.co/alice/tiny/commit/0"
    push, out = Mock(return_value=SimpleNamespace(commit_url=url)), tmp_path / "secret"  # the upload, recorded
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(diffusers_lmlp.hub, "push_pipeline", push)
    result = train_here(
        workspace, out, "--max_train_steps", "2", "--checkpointing_steps", "1", "--report_to", "tensorboard",
        "--validation_prompts", "a red circle", "--validation_steps", "1", "--validation_inference_steps", "1",
        "--push_to_hub", "--hub_model_id", "alice/tiny", "--hub_token", secret
    )  # fmt: skip
    assert push.call_args == call(out, "alice/tiny", token=secret, commit_message="End of training")
    assert url in result.stdout
    files, printed = [p for p in out.rglob("*") if p.is_file()], result.stdout + result.stderr
    hparams = next(p for p in files if p.name == "hparams.yml").read_text()
    assert "learning_rate" in hparams and "hub_model_id" in hparams  # the trackers still get the recipe
    assert any(p.name.startswith("events.out.tfevents") for p in files) and (out / "README.md") in files
    assert not [p for p in files if b"SECRETtest" in p.read_bytes()] and "SECRETtest" not in printed


def test_the_process_leaves_after_saving_only_when_asked(workspace, monkeypatch):
    saved = []

    def leave():
        saved.append({path.name for path in (workspace / "leaves").iterdir()})
        raise KeyboardInterrupt  # where `leave_finished_process` would end this test's process

    monkeypatch.setattr(finishing, "leave_finished_process", leave)
    train_here(workspace, "stays", "--max_train_steps", "1")  # without exit_when_done
    assert saved == [] and (workspace / "stays" / "model_index.json").is_file()
    threads = torch.get_num_threads()
    argv = [*train_args(workspace, "leaves"), "--max_train_steps", "1", "--num_threads", "1"]
    with pytest.raises(KeyboardInterrupt) as left:
        diffusers_lmlp.train.main(argv, exit_when_done=True)
    torch.set_num_threads(threads)
    assert {"model_index.json", "training_summary.json", "transformer", "README.md"} <= saved[0]
    # Left from inside end_run, with run_training's frame (the model, optimizer and data iterators) still alive.
    frames = [frame.name for frame in traceback.extract_tb(left.value.__traceback__)]
    assert frames[-3:-1] == ["run_training", "end_run"]


@pytest.mark.parametrize("world_size, leaves", [(None, False), ("1", False), ("2", True)])
def test_the_command_leaves_in_each_process_of_a_multi_process_run(world_size, leaves, monkeypatch):
    monkeypatch.setattr(diffusers_lmlp.train, "main", main := Mock())
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if world_size:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    diffusers_lmlp.train.cli()
    main.assert_called_once_with(exit_when_done=leaves)


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
def test_a_damaged_checkpoint_stops_the_run_or_latest_passes_over_it(straight, tmp_path, problem, damage, caplog):
    checkpoint = shutil.copytree(straight / "checkpoint-4", tmp_path / "checkpoint-4")
    damage(checkpoint)
    PartialState(cpu=True)  # for the warning `latest` logs about each damaged checkpoint
    with pytest.raises(SystemExit, match=f"the checkpoint {checkpoint} is damaged: {problem}"):
        checkpoint_to_resume(tmp_path, str(checkpoint))
    with pytest.raises(SystemExit, match=r"no checkpoint in .* is intact \(checkpoint-4 are damaged"):
        checkpoint_to_resume(tmp_path, "latest")
    shutil.copytree(straight / "checkpoint-2", tmp_path / "checkpoint-2")  # test_sigkill_… resumes exactly from it
    assert checkpoint_to_resume(tmp_path, "latest") == tmp_path / "checkpoint-2"
    assert "checkpoint-4 is damaged (" in caplog.text and "latest takes an earlier one" in caplog.text


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
    refusal = r"after step 3, 1 weight tensor\(s\) hold NaN or inf \(bias\), so nothing was"
    with pytest.raises(SystemExit, match=refusal) as e:
        require_finite_weights(model, None, 3, tmp_path, 1e-3)
    assert f"the newest intact checkpoint is {good}" in e.value.code


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
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4"]  # kept until later steps prove it healthy
    assert all_finite(out / "checkpoint-4")
    assert not (out / "model_index.json").exists() and not (out / "training_summary.json").exists()
    assert calls.call_count == 5 and len(values) == 4  # stopped at the first NaN, not trained on; steps 1-4 finished
    losses = logged(out)
    assert [step for step, _ in losses] == [3, 4]  # step 4, of the unfinished window, sent when the run stopped
    assert losses[1][1] == pytest.approx(values[3][0], rel=1e-6) and all(math.isfinite(v) for _, v in losses)
