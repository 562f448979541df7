"""docs/coco.md's commands, offline, on the COCO-2014 layout and a pre-filled HF cache; only the model, batch and steps
are tiny."""

import itertools
import json
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from coco_fixture import CLIP_REPO, CLIP_TEXT_WIDTH, SD_REPO, write_coco2014, write_hub_cache
from documents import blocks
from processes import run_bounded, warnings_in
from test_feature_store import write_store
from test_pipeline_loading import fill_hub_cache
from test_train_text_to_image import ENV, SCRIPT, free_port, load_script

from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.tiny import build_tiny_pipeline
from diffusers_lmlp.training import load_coco2014
from diffusers_lmlp.training.data import BatchSource, step_generator


ROOT = Path(__file__).resolve().parents[2]
BASH_BLOCKS = blocks("docs/coco.md", "bash")
COCO_COMMANDS = [
    line.split("#", 1)[0].strip()
    for block in BASH_BLOCKS
    for line in block.splitlines()
    if "--preset coco-f2" in line.split("#", 1)[0]
]
TINY = [
    "--model_overrides", "hidden_size=32", "num_layers=2", f"text_embed_dim={CLIP_TEXT_WIDTH}",
    "--train_batch_size", "2", "--lr_warmup_steps", "0", "--report_to", "none"
]  # fmt: skip
STEPS = ["--max_train_steps", "4", "--checkpointing_steps", "2"]
REPOS = (SD_REPO, CLIP_REPO)


SETUPS = {
    "1 GPU": lambda command: "--multi_gpu" not in command,
    "8 GPUs": lambda command: "--multi_gpu" in command and "--num_machines" not in command,
    "2 machines": lambda command: "--num_machines" in command,
}


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


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> SimpleNamespace:
    """A folder holding `coco2014/`, where the commands run, and the env of an HF cache of the recipe's components."""
    root = tmp_path_factory.mktemp("coco")
    write_coco2014(root / "coco2014")
    cache = write_hub_cache(root / "hf")
    env = {**ENV, "HF_HOME": str(root / "hf"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return SimpleNamespace(root=root, env=env)


def run(
    world, command: list[str], *extra: str, env: dict | None = None, quiet: bool = True
) -> subprocess.CompletedProcess:
    """Run a training command in the COCO folder; fail with its stderr, or (when `quiet`) on any warning."""
    result = run_bounded([*command, *extra], cwd=world.root, env=env or world.env, timeout=300)
    assert result.returncode == 0, f"{shlex.join(command + list(extra))} failed:\n{result.stderr[-5000:]}"
    assert not (quiet and warnings_in(result.stderr)), warnings_in(result.stderr)
    return result


@pytest.fixture(scope="module")
def straight(world) -> Path:
    """The 1-GPU command (batch 2 here, × 8 accumulation steps), 4 steps, checkpoints at 2 and 4."""
    result = run(world, readme_command("1 GPU"), *TINY, *STEPS, "--output_dir", "straight")
    assert "24 images ready" in result.stderr  # one sample per train2014 image, not per caption
    return world.root / "straight"


def test_readme_has_the_coco_commands():
    assert len(COCO_COMMANDS) == 3, COCO_COMMANDS
    for setup in ("1 GPU", "8 GPUs", "2 machines"):
        assert "--train_data_dir" in readme_command(setup, MACHINE_RANK="0", HEAD_IP="10.0.0.1")
    assert "$" not in " ".join(readme_command("2 machines", MACHINE_RANK="0", HEAD_IP="10.0.0.1"))


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
    images = pipe(
        ["A dog on a street.", "A woman in a kitchen."], num_inference_steps=2,
        generator=torch.Generator().manual_seed(0), output_type="pt"
    ).images  # fmt: skip
    assert images.shape == (2, 3, 256, 256) and torch.isfinite(images).all() and images.std() > 0


@pytest.mark.slow
def test_readme_downloads_are_the_files_the_run_reads_from_the_cache_or_as_local_folders(world, tmp_path):
    # The files the `hf download` lines name, and no others, in a fresh HF cache: the lines run, and the command trains
    # from it, with the VAE from a folder of them instead (`hf download ... --local-dir`; one run for both ways).
    downloads = [
        shlex.split(line.split("#", 1)[0])
        for block in BASH_BLOCKS
        for line in block.splitlines()
        if line.startswith("hf download ")
    ]
    assert sorted(argv[2] for argv in downloads) == sorted(REPOS), downloads
    cache = tmp_path / "hub"
    for argv in downloads:
        repo, files = argv[2], argv[3:]
        folder = tmp_path / "listed" / repo
        for name in files:
            source = world.root / "hf" / "repos" / repo / name
            assert source.is_file(), f"docs/coco.md downloads {name} from {repo}, which the repo has no file of"
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, folder / name)
        fill_hub_cache(folder, cache, repo)
    for argv in downloads:
        result = subprocess.run(argv, env={**world.env, "HF_HUB_CACHE": str(cache)}, capture_output=True, text=True)
        assert result.returncode == 0, f"{shlex.join(argv)}:\n{result.stderr}"
    run(world, readme_command("1 GPU"), *TINY, "--max_train_steps", "1", "--output_dir", "downloaded",
        "--pretrained_vae", str(tmp_path / "listed" / SD_REPO), env={**world.env, "HF_HUB_CACHE": str(cache)})  # fmt: skip
    pipe = LMLPPipeline.from_pretrained(world.root / "downloaded")
    assert pipe.vae.config.scaling_factor == pytest.approx(0.23010)
    assert pipe.text_encoder.config.hidden_size == CLIP_TEXT_WIDTH


@pytest.mark.slow
def test_two_cpu_processes_train_together(world):
    # The README's multi-GPU command on 2 CPU processes, with ACCELERATE_USE_CPU=1 as its CPU line documents.
    command = readme_command("8 GPUs")
    command[command.index("--num_processes") + 1] = "2"
    command[3:3] = ["--main_process_port", str(free_port())]
    run(world, command, *TINY, "--max_train_steps", "2", "--output_dir", "ddp", env={**world.env,
        "ACCELERATE_USE_CPU": "1"})  # fmt: skip
    summary = json.loads((world.root / "ddp" / "training_summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["ranks_in_sync"] is True
    assert (world.root / "ddp" / "checkpoint-2").is_dir()


@pytest.mark.slow
def test_two_machines_command_trains_as_one_run(world):
    # 2 "machines" of 1 CPU process each on this host (the head at 127.0.0.1), sharing a local folder.
    shared, port = world.root / "shared", str(free_port())
    commands = []
    for rank in ("0", "1"):
        command = readme_command("2 machines", MACHINE_RANK=rank, HEAD_IP="127.0.0.1")
        command[command.index("--num_processes") + 1] = "2"
        command[command.index("--main_process_port") + 1] = port
        command = [arg.replace("/shared/coco2014", str(world.root / "coco2014")) for arg in command]
        commands.append([arg.replace("/shared/", f"{shared}/") for arg in command])
    env = {**world.env, "ACCELERATE_USE_CPU": "1"}
    with ThreadPoolExecutor(2) as pool:
        machines = [
            pool.submit(run_bounded, [*command, *TINY, "--max_train_steps", "2"], cwd=world.root, env=env, timeout=300)
            for command in commands
        ]
        results = [machine.result() for machine in machines]
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"machine {rank}:\n{result.stderr[-5000:]}"
        assert not warnings_in(result.stderr), warnings_in(result.stderr)
    summary = json.loads((shared / "lmlp-coco-f2" / "training_summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["ranks_in_sync"] is True
    assert (shared / "lmlp-coco-f2" / "checkpoint-2").is_dir()
    assert len(list((shared / "lmlp-cache" / "features").glob("*/manifest.json"))) == 1


# ------------------------------------------------------------------------------------------ the COCO reader


@pytest.fixture(scope="module")
def coco(tmp_path_factory) -> Path:
    return write_coco2014(tmp_path_factory.mktemp("layout") / "coco2014", num_train=8, num_val=2, seed=1)


def test_coco_reader_gives_one_row_per_image_with_all_its_captions(coco):
    annotations = json.loads((coco / "annotations" / "captions_train2014.json").read_text())
    dataset = load_coco2014(coco)
    ids = sorted(image["id"] for image in annotations["images"])
    assert dataset["image_id"] == ids and len(dataset) == 8
    for row in dataset:
        expected = [a["caption"] for a in annotations["annotations"] if a["image_id"] == row["image_id"]]
        assert row["text"] == expected and 5 <= len(expected) <= 7
        meta = next(image for image in annotations["images"] if image["id"] == row["image_id"])
        assert row["image"].size == (meta["width"], meta["height"])
    assert {len(captions) for captions in dataset["text"]} > {5}  # some images have 6 or 7, as in COCO
    assert len(load_coco2014(coco, "val2014")) == 2


def test_a_listed_but_missing_image_is_named(coco, tmp_path):
    shutil.copytree(coco, tmp_path / "coco")
    victim = sorted((tmp_path / "coco" / "train2014").iterdir())[3]
    victim.unlink()
    with pytest.raises(ValueError, match=re.escape(f"lists 1 image(s) that {victim.parent} lacks, e.g. {victim}")):
        load_coco2014(tmp_path / "coco")


def test_each_use_of_an_image_picks_one_of_its_captions_from_the_step_generator(coco, tmp_path):
    # The feature store's text states are tagged by row, so the rows the batches pick can be read back.
    dataset = load_coco2014(coco)
    counts = [len(captions) for captions in dataset["text"]]
    states = torch.arange(sum(counts), dtype=torch.float32)[:, None, None].expand(-1, 77, CLIP_TEXT_WIDTH)  # (M, T, D)
    store = write_store(tmp_path, torch.zeros(len(dataset), 8, 2, 2), states, counts)
    pipe = build_tiny_pipeline(text_seq_len=77)
    args = SimpleNamespace(
        seed=0, caption_dropout=0.0, streaming=False, train_batch_size=8, gradient_accumulation_steps=1
    )
    source = BatchSource(args, dataset, store, pipe.tokenizer, pipe.text_encoder, pipe.vae, 0)

    def picked(step: int) -> list[tuple[int, int]]:
        positions = list(range(8 * step, 8 * step + 8))
        _, text_states = source.batch(positions, step_generator(0, "step", step, 0))
        return [(source.reader.sample_index(p), int(row)) for p, row in zip(positions, text_states[:, 0, 0])]

    offsets, used = [0, *itertools.accumulate(counts)], {pair for step in range(40) for pair in picked(step)}
    assert all(offsets[image] <= row < offsets[image + 1] for image, row in used)  # one of its own captions
    assert {row for _, row in used} == set(range(sum(counts)))  # every caption of every image is used
    assert picked(7) == picked(7)  # a pure function of the step: a resumed run picks the same


def test_a_bad_coco_folder_stops_the_script_naming_the_file(world, coco, tmp_path):
    # --data_layout auto: a folder with train2014/ and no imagefolder metadata is a COCO folder partly unpacked.
    broken = tmp_path / "coco2014"
    shutil.copytree(coco / "train2014", broken / "train2014")  # annotations/ was not unpacked
    repos = world.root / "hf" / "repos"
    argv = [
        "--preset", "coco-f2", "--train_data_dir", str(broken), *TINY, "--output_dir", str(tmp_path / "out"),
        "--pretrained_vae", str(repos / "CompVis" / "stable-diffusion-v1-4"),
        "--pretrained_text_encoder", str(repos / "openai" / "clip-vit-large-patch14")
    ]  # fmt: skip
    with pytest.raises(SystemExit) as error:
        load_script().main(argv)
    assert f"is not a COCO-2014 folder: {broken / 'annotations' / 'captions_train2014.json'} is missing" in str(
        error.value.code
    )
