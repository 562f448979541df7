"""docs/coco.md's commands offline on COCO-2014 and an HF cache, tiny; their VAE and CLIP in either layout or place"""

import dataclasses
import itertools
import json
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from coco_fixture import CLIP_REPO, CLIP_TEXT_WIDTH, SD_REPO, write_clip_repo, write_coco2014, write_sd_vae_repo
from documents import blocks
from processes import run_bounded, warnings_in
from safetensors.torch import load_file, save_file
from test_feature_store import write_store
from test_pipeline_loading import fill_hub_cache
from test_train_text_to_image import ENV, SCRIPT, free_port
from transformers import CLIPTextModel, CLIPTokenizer

from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.tiny import build_tiny_pipeline
from diffusers_lmlp.training import arguments, components, load_coco2014
from diffusers_lmlp.training.arguments import TextEncoderSource, VaeSource, load_text_encoder, resolve_text_encoder
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
    """The 1-GPU command, 4 steps, checkpoints at 2 and 4, from the docs' `hf download` files alone (cache, folder)."""
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


def test_each_use_of_an_image_picks_one_of_its_captions_from_the_step_generator(tmp_path):
    # The feature store's text states are tagged by row, so the rows the batches pick can be read back.
    dataset = load_coco2014(write_coco2014(tmp_path / "coco2014", num_train=8, num_val=2, seed=1))
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


STANDALONE_VAE_REPO = "stabilityai/sd-vae-ft-mse"


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> SimpleNamespace:
    """The three repos as local folders, the same in an HF cache under their real ids, and a COCO-2014 folder."""
    root = tmp_path_factory.mktemp("components")
    clip = write_clip_repo(root / "repos" / CLIP_REPO)
    # CompVis/stable-diffusion-v1-4's layout, with other VAE weights than the standalone one's, to tell which loaded
    sd = write_sd_vae_repo(root / "repos" / SD_REPO, seed=1)
    CLIPTextModel.from_pretrained(clip).save_pretrained(sd / "text_encoder")
    CLIPTokenizer.from_pretrained(clip).save_pretrained(sd / "tokenizer")
    # stabilityai/sd-vae-ft-mse's layout, with a .bin that no unpickler accepts: loading must never open it
    standalone = shutil.copytree(write_sd_vae_repo(root / "sd0") / "vae", root / "repos" / STANDALONE_VAE_REPO)
    (standalone / "diffusion_pytorch_model.bin").write_bytes(b"not a pickle")
    for folder, repo_id in ((clip, CLIP_REPO), (sd, SD_REPO), (standalone, STANDALONE_VAE_REPO)):
        fill_hub_cache(folder, root / "hub", repo_id)
    coco = write_coco2014(root / "coco2014")
    return SimpleNamespace(cache=root / "hub", clip=clip, sd=sd, standalone=standalone, coco=coco)


@pytest.fixture
def offline_cache(repos, monkeypatch) -> Path:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(repos.cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return repos.cache


def source(repos, name: str, where: str) -> str:
    ids = {"standalone": STANDALONE_VAE_REPO, "sd": SD_REPO, "clip": CLIP_REPO}
    return str(getattr(repos, name)) if where == "folder" else ids[name]


def preset_args(repos, preset: str, tmp_path: Path, *extra: str) -> list[str]:
    own = TINY if preset == "coco-f2" else ["--data_layout", "coco2014"]
    return ["--preset", preset, "--train_data_dir", str(repos.coco), *own, "--output_dir", str(tmp_path / "out"),
            "--report_to", "none", "--max_train_steps", "1", *extra]  # fmt: skip


VAE_LAYOUTS = {"standalone": VaeSource("{}", ""), "sd": VaeSource("{}", "vae")}
TEXT_LAYOUTS = {"clip": TextEncoderSource("{}", "", ""), "sd": TextEncoderSource("{}", "text_encoder", "tokenizer")}


@pytest.mark.slow
@pytest.mark.parametrize("vae, text, where", [("standalone", "clip", "hub cache"), ("sd", "sd", "folder")])
def test_every_preset_loads_the_components_of_either_layout(script, repos, offline_cache, tmp_path, where, vae, text):
    given = ["--pretrained_vae", source(repos, vae, where), "--pretrained_text_encoder", source(repos, text, where)]
    for preset in ("coco-f2", "shapes", "shapes-lora"):
        args = script.parse_args(preset_args(repos, preset, tmp_path, *given))
        assert args.vae_source.subfolder == VAE_LAYOUTS[vae].subfolder
        assert args.text_encoder_source.subfolder == TEXT_LAYOUTS[text].subfolder
        sources = dict(text_encoder=args.text_encoder_source, vae=args.vae_source, latent_scale=args.latent_scale)
        components.load_components(pretrained=args.pretrained_model_name_or_path, world=args.world, **sources)


def test_the_default_ids_resolve_from_the_cache_and_vae_subfolder_wins(script, repos, offline_cache, tmp_path):
    args = script.parse_args(preset_args(repos, "coco-f2", tmp_path))
    assert args.vae_source == VaeSource(SD_REPO, "vae")
    assert args.text_encoder_source == TextEncoderSource(CLIP_REPO, "", "")
    # A copy of the VAE at the root of the pipeline folder: detection prefers it, and --vae_subfolder vae picks vae/.
    both = shutil.copytree(repos.sd, tmp_path / "both")
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        shutil.copy(repos.standalone / name, both / name)
    argv = preset_args(repos, "coco-f2", tmp_path, "--pretrained_vae", str(both))
    assert script.parse_args(argv).vae_source.subfolder == ""
    assert script.parse_args([*argv, "--vae_subfolder", "vae"]).vae_source.subfolder == "vae"


@pytest.mark.parametrize(
    "given, expected",
    [
        ("empty", ["--pretrained_vae {} holds no VAE: it has neither a config.json", "vae/config.json"]),
        ("someone/not-downloaded", ["--pretrained_vae {}: the VAE", "HF_HUB_OFFLINE=1 keeps it from downloading",
                                    "hf download someone/not-downloaded"])
    ]
)  # fmt: skip
def test_a_vae_source_without_a_vae_says_what_to_do(script, repos, offline_cache, tmp_path, capsys, given, expected):
    if given == "empty":  # a folder without a VAE; else a repo missing from the offline cache
        (given := tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        script.parse_args(preset_args(repos, "coco-f2", tmp_path, "--pretrained_vae", str(given)))
    message = capsys.readouterr().err
    assert all(text.format(given) in message for text in expected), message


@pytest.mark.slow
def test_a_standalone_vae_trains_with_the_readme_coco_command(repos, tmp_path):
    shutil.copytree(repos.coco, tmp_path / "coco2014")
    extra = [*TINY, "--max_train_steps", "1", "--output_dir", "run", "--pretrained_vae", STANDALONE_VAE_REPO]
    env = {**ENV, "HF_HUB_CACHE": str(repos.cache), "HF_HUB_OFFLINE": "1"}
    result = run_bounded([*readme_command("1 GPU"), *extra], cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    saved = json.loads((tmp_path / "run" / "vae" / "config.json").read_text())
    assert saved["scaling_factor"] == pytest.approx(0.23010)  # the recipe's latent scale travels with the VAE
    weights = load_file(tmp_path / "run" / "vae" / "diffusion_pytorch_model.safetensors")
    expected = load_file(repos.standalone / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


@pytest.mark.parametrize("where", ["folder", "hub cache"])
@pytest.mark.parametrize("kind, name", [("text", "clip"), ("text", "sd"), ("vae", "standalone"), ("vae", "sd")])
def test_a_component_is_read_in_its_layout_and_every_tensor_loads(repos, offline_cache, kind, name, where, capfd):
    given = source(repos, name, where)
    resolved = (resolve_text_encoder if kind == "text" else arguments.resolve_vae)(given, None)
    assert resolved == dataclasses.replace((TEXT_LAYOUTS if kind == "text" else VAE_LAYOUTS)[name], source=given)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_text_encoder(resolved) if kind == "text" else arguments.load_vae(resolved)
    stderr = capfd.readouterr().err.replace("\r", "\n")
    assert not [line for line in stderr.splitlines() if line and "it/s]" not in line] and caught == []
    weights = "model.safetensors" if kind == "text" else "diffusion_pytorch_model.safetensors"
    model = loaded[1] if kind == "text" else loaded
    saved, state = load_file(getattr(repos, name) / resolved.subfolder / weights), model.state_dict()
    # A CLIP checkpoint's names are the CLIPModel's (`text_model.…`); transformers 5 may drop that prefix.
    names = {key: key if key in saved else f"text_model.{key}" for key in state}
    assert set(names.values()) <= saved.keys() and all(torch.equal(state[key], saved[names[key]]) for key in state)
    if kind == "text":
        assert loaded[0]("a red dog").input_ids == CLIPTokenizer.from_pretrained(repos.clip)("a red dog").input_ids
    if name == "clip":  # a whole CLIP checkpoint, as the Hub repo's
        assert any(key.startswith("vision_model.") for key in saved)


def test_a_hub_component_fetches_only_its_config_tokenizer_and_safetensors_or_shards(repos, tmp_path, monkeypatch):
    """Online, only the files the trainer reads: no .bin, .h5 or .msgpack, nor tokenizer.json (docs/coco.md)."""
    fetched, not_found = [], SimpleNamespace(headers={}, request=None)  # huggingface_hub's error reads its headers

    def hf_hub_download(repo_id, filename, revision=None):  # from the repo's folder, as the Hub would answer
        folder = repos.clip if repo_id == CLIP_REPO else sharded
        fetched.append(filename)
        if not (folder / filename).is_file():
            raise huggingface_hub.errors.RemoteEntryNotFoundError(f"404 {filename}", response=not_found)
        return str(folder / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    load_text_encoder(TextEncoderSource(CLIP_REPO, "", ""))
    assert fetched == ["config.json", "model.safetensors", *arguments.TOKENIZER_FILE_NAMES]
    sharded = shutil.copytree(repos.standalone, tmp_path / "sharded")
    tensors = load_file(sharded / "diffusion_pytorch_model.safetensors")
    (sharded / "diffusion_pytorch_model.safetensors").unlink()
    halves = {f"diffusion_pytorch_model-0000{i + 1}-of-00002.safetensors": sorted(tensors)[i::2] for i in range(2)}
    for shard, keys in halves.items():
        save_file({key: tensors[key] for key in keys}, sharded / shard)
    index = "diffusion_pytorch_model.safetensors.index.json"
    weight_map = {key: shard for shard, keys in halves.items() for key in keys}
    (sharded / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    fetched.clear()
    vae = arguments.load_vae(VaeSource(STANDALONE_VAE_REPO, ""))
    assert fetched == ["config.json", "diffusion_pytorch_model.safetensors", index, *halves]
    assert all(torch.equal(value, tensors[key]) for key, value in vae.state_dict().items())


def test_a_text_checkpoint_lacking_tensors_or_holding_others_is_refused(script, repos, offline_cache, tmp_path):
    lacking, other = (shutil.copytree(repos.clip, tmp_path / name) for name in ("lacking", "other"))
    tensors = load_file(repos.clip / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "final_layer_norm" not in k}, lacking / "model.safetensors")
    save_file({**tensors, "unet.conv.weight": torch.zeros(1)}, other / "model.safetensors")
    with pytest.raises(ValueError) as error:
        load_text_encoder(resolve_text_encoder(str(lacking), None))
    # The names as transformers reports them (transformers 5 leaves out the checkpoint's "text_model." prefix).
    bias, weight = (rf"(text_model\.)?final_layer_norm\.{name}" for name in ("bias", "weight"))
    start = f"--pretrained_text_encoder {lacking}: the checkpoint lacks 2 of the CLIP text model's tensors ("
    end = "). Pass a CLIP text model or a full CLIP."
    assert re.fullmatch(f"{re.escape(start)}{bias}, {weight}{re.escape(end)}", str(error.value)), str(error.value)
    with pytest.raises(ValueError, match=r"holds 1 tensors that are not a CLIP text model's \(unet\.conv\.weight\)"):
        load_text_encoder(resolve_text_encoder(str(other), None))
    args = script.parse_args(preset_args(repos, "coco-f2", tmp_path, "--pretrained_text_encoder", str(lacking)))
    with pytest.raises(SystemExit, match=r"^error: --pretrained_text_encoder .*lacking: the checkpoint lacks 2 "):
        components.load_components(text_encoder=args.text_encoder_source, vae=args.vae_source)
