"""`--pretrained_vae` and `--pretrained_text_encoder`: either layout, from a folder or the HF cache, every preset."""

import dataclasses
import json
import re
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from coco_fixture import CLIP_REPO, CLIP_TEXT_WIDTH, SD_REPO, write_clip_repo, write_coco2014, write_sd_vae_repo
from processes import run_bounded
from safetensors.torch import load_file, save_file
from test_pipeline_loading import fill_hub_cache
from test_train_coco import readme_command
from test_train_text_to_image import ENV
from transformers import CLIPTextModel, CLIPTokenizer

from diffusers_lmlp.training import arguments, components
from diffusers_lmlp.training.arguments import TextEncoderSource, VaeSource, load_text_encoder, resolve_text_encoder


STANDALONE_VAE_REPO = "stabilityai/sd-vae-ft-mse"
# Tiny COCO-recipe runs: the F2-deep skeleton narrowed to the stand-ins' widths.
TINY = ["--model_overrides", "hidden_size=32", "num_layers=2", f"text_embed_dim={CLIP_TEXT_WIDTH}"]


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
    """The documented 1-GPU COCO command with `--pretrained_vae stabilityai/sd-vae-ft-mse` from the cache."""
    shutil.copytree(repos.coco, tmp_path / "coco2014")
    extra = [*TINY, "--train_batch_size", "2", "--lr_warmup_steps", "0", "--report_to", "none", "--max_train_steps"]
    extra += ["1", "--output_dir", "run", "--pretrained_vae", STANDALONE_VAE_REPO]
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
