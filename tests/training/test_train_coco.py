"""docs/coco.md's commands, offline, on the COCO-2014 layout and a pre-filled HF cache, with a tiny model and run."""

import itertools
import json
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from coco_fixture import CLIP_REPO, CLIP_TEXT_WIDTH, SD_REPO, write_coco2014
from documents import blocks
from processes import run_bounded, warnings_in
from test_feature_store import write_store
from test_pipeline_loading import fill_hub_cache
from test_train_text_to_image import SCRIPT, free_port

from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.tiny import build_tiny_pipeline
from diffusers_lmlp.training import load_coco2014
from diffusers_lmlp.training.data import BatchReader, BatchSource, step_generator


LINES = [line.split("#", 1)[0].strip() for block in blocks("docs/coco.md", "bash") for line in block.splitlines()]
COCO_COMMANDS = [line for line in LINES if "--preset coco-f2" in line]
TINY = ["--model_overrides", "hidden_size=32", "num_layers=2", f"text_embed_dim={CLIP_TEXT_WIDTH}",
        "--train_batch_size", "2", "--lr_warmup_steps", "0", "--report_to", "none"]  # fmt: skip
SETUPS = {"1 GPU": lambda command: "--multi_gpu" not in command,  # which of the docs' commands is which
          "8 GPUs": lambda command: "--multi_gpu" in command and "--num_machines" not in command,
          "2 machines": lambda command: "--num_machines" in command}  # fmt: skip


def readme_command(setup: str, **values: str) -> list[str]:
    """The docs' COCO command for `setup` as argv, `accelerate` run by this Python, its `$NAME`s set to `values`."""
    [command] = [c for c in COCO_COMMANDS if SETUPS[setup](c)]
    for name, value in values.items():
        command = command.replace(f"${name}", value)
    argv = shlex.split(command)
    assert argv[:2] == ["accelerate", "launch"], command
    argv[argv.index("examples/train_text_to_image.py")] = str(SCRIPT)
    argv[argv.index("examples/accelerate.yaml")] = str(SCRIPT.parent / "accelerate.yaml")  # runs from coco's folder
    return [sys.executable, "-m", "accelerate.commands.launch", *argv[2:]]


def run(coco_world, command: list[str], *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a training command in the COCO folder; fail with its stderr, or on any warning."""
    result = run_bounded([*command, *extra], cwd=coco_world.root, env=env or coco_world.env, timeout=300)
    assert result.returncode == 0 and not warnings_in(result.stderr), result.stderr[-5000:]
    return result


@pytest.fixture(scope="module")
def straight(coco_world, tmp_path_factory) -> Path:
    """The 1-GPU command (batch 2, × 8 accumulation steps), 4 steps, checkpoints at 2 and 4, from the files the docs'
    `hf download` lines name alone: a fresh HF cache of them where the lines run, and the VAE from a folder of them."""
    listed, cache = tmp_path_factory.mktemp("listed"), tmp_path_factory.mktemp("hub")
    downloads = [shlex.split(line) for line in LINES if line.startswith("hf download ")]
    assert sorted(argv[2] for argv in downloads) == sorted((SD_REPO, CLIP_REPO)), downloads
    for repo, *files in (argv[2:] for argv in downloads):
        for name in files:
            source = coco_world.root / "hf" / "repos" / repo / name
            assert source.is_file(), f"docs/coco.md downloads {name} from {repo}, which the repo has no file of"
            (listed / repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, listed / repo / name)
        fill_hub_cache(listed / repo, cache, repo)
    env = {**coco_world.env, "HF_HUB_CACHE": str(cache)}
    for argv in downloads:
        result = subprocess.run(argv, env=env, capture_output=True, text=True)
        assert result.returncode == 0, f"{shlex.join(argv)}:\n{result.stderr}"
    result = run(coco_world, readme_command("1 GPU"), *TINY, "--max_train_steps", "4", "--checkpointing_steps", "2",
                 "--output_dir", "straight", "--pretrained_vae", str(listed / SD_REPO), env=env)  # fmt: skip
    assert "24 images ready" in result.stderr  # one sample per train2014 image, not per caption
    return coco_world.root / "straight"


def test_readme_has_the_coco_commands():
    assert len(COCO_COMMANDS) == 3, COCO_COMMANDS
    for setup in SETUPS:
        argv = readme_command(setup, MACHINE_RANK="0", HEAD_IP="10.0.0.1")
        assert "--train_data_dir" in argv and "$" not in " ".join(argv)


@pytest.mark.slow
def test_one_gpu_command_trains_from_the_default_ids_and_the_pipeline_samples(straight):
    summary = json.loads((straight / "training_summary.json").read_text())
    assert summary["steps"] == 4 and summary["num_processes"] == 1
    assert sorted(p.name for p in straight.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    pipe = LMLPPipeline.from_pretrained(straight)
    assert pipe.vae.config.scaling_factor == pytest.approx(0.23010)  # the recipe's COCO scale travels with the VAE
    assert len(pipe.vae.config.block_out_channels) == 4 and pipe.native_size == 256  # SD's ×8 at 256 px
    assert pipe.tokenizer.model_max_length == 77 and pipe.text_encoder.config.hidden_size == CLIP_TEXT_WIDTH
    pipe.set_progress_bar_config(disable=True)
    prompts = ["A dog on a street.", "A woman in a kitchen."]
    images = pipe(prompts, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert images.shape == (2, 3, 256, 256) and torch.isfinite(images).all() and images.std() > 0


@pytest.mark.slow
def test_readme_downloads_are_the_files_the_run_reads_from_the_cache_or_as_local_folders(straight):
    pipe = LMLPPipeline.from_pretrained(straight)  # CLIP from the cache of the listed files, the VAE from their folder
    assert pipe.vae.config.scaling_factor == pytest.approx(0.23010) and pipe.text_encoder.config.hidden_size == 32


@pytest.mark.slow
def test_two_cpu_processes_train_together(coco_world):
    # The README's multi-GPU command on 2 CPU processes, with ACCELERATE_USE_CPU=1 as its CPU line documents.
    command = readme_command("8 GPUs")
    command[command.index("--num_processes") + 1] = "2"
    command[3:3] = ["--main_process_port", str(free_port())]
    env = {**coco_world.env, "ACCELERATE_USE_CPU": "1"}
    run(coco_world, command, *TINY, "--max_train_steps", "2", "--output_dir", "ddp", env=env)
    summary = json.loads((coco_world.root / "ddp" / "training_summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["ranks_in_sync"] is True
    assert (coco_world.root / "ddp" / "checkpoint-2").is_dir()


@pytest.mark.slow
def test_two_machines_command_trains_as_one_run(coco_world):
    # 2 "machines" of 1 CPU process each on this host (the head at 127.0.0.1), sharing a local folder.
    shared, port, env = coco_world.root / "shared", str(free_port()), {**coco_world.env, "ACCELERATE_USE_CPU": "1"}

    def machine(rank: str) -> subprocess.CompletedProcess:
        command = readme_command("2 machines", MACHINE_RANK=rank, HEAD_IP="127.0.0.1")
        command[command.index("--num_processes") + 1] = "2"
        command[command.index("--main_process_port") + 1] = port
        command = [arg.replace("/shared/coco2014", str(coco_world.root / "coco2014")) for arg in command]
        command = [arg.replace("/shared/", f"{shared}/") for arg in command]
        return run(coco_world, command, *TINY, "--max_train_steps", "2", env=env)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(machine, ("0", "1")))
    summary = json.loads((shared / "lmlp-coco-f2" / "training_summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["ranks_in_sync"] is True
    assert (shared / "lmlp-coco-f2" / "checkpoint-2").is_dir()
    assert len(list((shared / "lmlp-cache" / "features").glob("*/manifest.json"))) == 1


@pytest.fixture(scope="module")
def coco(tmp_path_factory) -> Path:
    return write_coco2014(tmp_path_factory.mktemp("layout") / "coco2014", num_train=8, num_val=2, seed=1)


def test_each_use_of_an_image_picks_one_of_its_captions_from_the_step_generator(coco, tmp_path):
    # The feature store's text states are tagged by row, so the rows the batches pick can be read back.
    dataset = load_coco2014(coco)
    counts = [len(captions) for captions in dataset["text"]]
    states = torch.arange(sum(counts), dtype=torch.float32)[:, None, None].expand(-1, 77, CLIP_TEXT_WIDTH)  # (M, T, D)
    store = write_store(tmp_path, torch.zeros(len(dataset), 8, 2, 2), states, counts)
    pipe = build_tiny_pipeline(text_seq_len=77)
    reader = BatchReader(dataset, store, seed=0, per_step=8)
    source = BatchSource(reader, pipe.tokenizer, pipe.text_encoder, pipe.vae)

    def picked(step: int) -> list[tuple[int, int]]:
        positions = list(range(8 * step, 8 * step + 8))
        _, text_states = source.batch(positions, step_generator(0, "step", step, 0))
        return [(source.reader.sample_index(p), int(row)) for p, row in zip(positions, text_states[:, 0, 0])]

    offsets, used = [0, *itertools.accumulate(counts)], {pair for step in range(40) for pair in picked(step)}
    assert all(offsets[image] <= row < offsets[image + 1] for image, row in used)  # one of its own captions
    assert {row for _, row in used} == set(range(sum(counts)))  # every caption of every image is used
    assert picked(7) == picked(7)  # a pure function of the step: a resumed run picks the same
