"""`--pretrained_vae` and `--pretrained_text_encoder` take a standalone model or a full pipeline, from a folder or the
HF cache, under every preset, their layout detected; the stand-ins are laid out file for file as the Hub repos."""

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
from safetensors.torch import load_file, save_file
from test_pipeline_loading import fill_hub_cache
from transformers import CLIPTextModel, CLIPTokenizer

from diffusers_lmlp.training import components
from diffusers_lmlp.training.arguments import (
    TOKENIZER_FILE_NAMES,
    TextEncoderSource,
    VaeSource,
    load_text_encoder,
    load_vae,
    resolve_text_encoder,
    resolve_vae,
)


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
    standalone = root / "repos" / STANDALONE_VAE_REPO
    shutil.copytree(write_sd_vae_repo(root / "sd0") / "vae", standalone)
    (standalone / "diffusion_pytorch_model.bin").write_bytes(b"not a pickle")
    cache = root / "hub"
    for folder, repo_id in ((clip, CLIP_REPO), (sd, SD_REPO), (standalone, STANDALONE_VAE_REPO)):
        fill_hub_cache(folder, cache, repo_id)
    return SimpleNamespace(
        root=root, cache=cache, clip=clip, sd=sd, standalone=standalone, coco=write_coco2014(root / "coco2014")
    )


@pytest.fixture
def offline_cache(repos, monkeypatch) -> Path:
    """The HF cache of `repos`, read offline."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(repos.cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return repos.cache


def source(repos, name: str, where: str) -> str:
    """The `--pretrained_*` value of repo `name`: its local folder, or its Hub id."""
    ids = {"standalone": STANDALONE_VAE_REPO, "sd": SD_REPO, "clip": CLIP_REPO}
    return str(getattr(repos, name)) if where == "folder" else ids[name]


def preset_args(repos, preset: str, tmp_path: Path) -> list[str]:
    """A run of `preset` on data, as a user gives it."""
    own = TINY if preset == "coco-f2" else ["--data_layout", "coco2014"]
    return ["--preset", preset, "--train_data_dir", str(repos.coco), *own, "--output_dir", str(tmp_path / "out"),
            "--report_to", "none", "--max_train_steps", "1"]  # fmt: skip


VAE_LAYOUTS = {"standalone": VaeSource("{}", ""), "sd": VaeSource("{}", "vae")}
TEXT_LAYOUTS = {"clip": TextEncoderSource("{}", "", ""), "sd": TextEncoderSource("{}", "text_encoder", "tokenizer")}


@pytest.mark.parametrize("where", ["folder", "hub cache"])
@pytest.mark.parametrize(
    "resolve, layouts, name",
    [(resolve_vae, VAE_LAYOUTS, "standalone"), (resolve_vae, VAE_LAYOUTS, "sd"),
     (resolve_text_encoder, TEXT_LAYOUTS, "clip"), (resolve_text_encoder, TEXT_LAYOUTS, "sd")],
    ids=["vae-standalone", "vae-sd", "text-clip", "text-sd"]
)  # fmt: skip
def test_a_component_source_is_read_in_its_own_layout(repos, offline_cache, resolve, layouts, name, where):
    given = source(repos, name, where)
    assert resolve(given, None) == dataclasses.replace(layouts[name], source=given)


@pytest.mark.slow
@pytest.mark.parametrize("vae, text, where", [("standalone", "clip", "hub cache"), ("sd", "sd", "folder")])
def test_every_preset_loads_the_components_from_either_layout(
    script, repos, offline_cache, tmp_path, where, vae, text
):
    given = ["--pretrained_vae", source(repos, vae, where), "--pretrained_text_encoder", source(repos, text, where)]
    for preset in ("coco-f2", "shapes", "shapes-lora"):
        args = script.parse_args([*preset_args(repos, preset, tmp_path), *given])
        assert args.vae_source.subfolder == VAE_LAYOUTS[vae].subfolder
        assert args.text_encoder_source.subfolder == TEXT_LAYOUTS[text].subfolder
        tokenizer, text_encoder, loaded_vae = components.load_components(args)
    # The weights that loaded are the ones of the layout given, read from safetensors (the .bin would fail).
    folder = repos.standalone if vae == "standalone" else repos.sd / "vae"
    expected = load_file(folder / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(loaded_vae.state_dict()[k], expected[k]) for k in expected)
    text_folder = repos.clip if text == "clip" else repos.sd / "text_encoder"
    expected = load_file(text_folder / "model.safetensors")  # a CLIPModel's keys start with text_model.
    expected = {k.removeprefix("text_model."): v for k, v in expected.items()}
    state = {k.removeprefix("text_model."): v for k, v in text_encoder.state_dict().items()}
    assert all(torch.equal(state[k], expected[k]) for k in state)
    assert (
        tokenizer("a dog on a street").input_ids
        == CLIPTokenizer.from_pretrained(repos.clip)("a dog on a street").input_ids
    )


@pytest.mark.parametrize("where", ["folder", "hub cache"])
def test_vae_subfolder_overrides_the_detection(script, repos, offline_cache, tmp_path, where):
    argv = preset_args(repos, "coco-f2", tmp_path) + ["--pretrained_vae", source(repos, "sd", where)]
    assert script.parse_args(argv).vae_source.subfolder == "vae"
    # A copy of the VAE at the root of the pipeline folder: detection prefers it, and --vae_subfolder vae picks vae/.
    both = tmp_path / "both"
    shutil.copytree(repos.sd, both)
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        shutil.copy(repos.standalone / name, both / name)
    argv = preset_args(repos, "coco-f2", tmp_path) + ["--pretrained_vae", str(both)]
    assert script.parse_args(argv).vae_source.subfolder == ""
    assert script.parse_args([*argv, "--vae_subfolder", "vae"]).vae_source.subfolder == "vae"


def test_the_preset_default_ids_resolve_from_the_cache(script, repos, offline_cache, tmp_path):
    args = script.parse_args(preset_args(repos, "coco-f2", tmp_path))
    assert (args.vae_source, args.text_encoder_source) == (
        VaeSource(SD_REPO, "vae"),
        TextEncoderSource(CLIP_REPO, "", ""),
    )


@pytest.mark.parametrize(
    "given, expected",
    [
        ("empty", ["--pretrained_vae {} holds no VAE: it has neither a config.json", "vae/config.json"]),
        ("someone/not-downloaded", ["--pretrained_vae {}: the VAE", "HF_HUB_OFFLINE=1 keeps it from downloading",
                                    "hf download someone/not-downloaded"])
    ]
)  # fmt: skip
def test_a_vae_source_without_a_vae_is_named_with_what_to_do(
    script, repos, offline_cache, tmp_path, capsys, given, expected
):
    if given == "empty":  # a folder without a VAE; else a repo missing from the offline cache
        given = tmp_path / "empty"
        given.mkdir()
    with pytest.raises(SystemExit):
        script.parse_args(preset_args(repos, "coco-f2", tmp_path) + ["--pretrained_vae", str(given)])
    message = capsys.readouterr().err
    assert all(text.format(given) in message for text in expected), message


@pytest.mark.slow
def test_a_standalone_vae_trains_with_the_readme_coco_command(repos, tmp_path):
    """The documented 1-GPU COCO command with `--pretrained_vae stabilityai/sd-vae-ft-mse` from the cache."""
    from test_train_coco import readme_command, run_bounded
    from test_train_text_to_image import ENV

    env = {**ENV, "HF_HUB_CACHE": str(repos.cache), "HF_HUB_OFFLINE": "1"}
    shutil.copytree(repos.coco, tmp_path / "coco2014")
    command = readme_command("1 GPU")
    extra = [*TINY, "--train_batch_size", "2", "--lr_warmup_steps", "0", "--report_to", "none"]
    extra += ["--max_train_steps", "1", "--output_dir", "run", "--pretrained_vae", STANDALONE_VAE_REPO]
    result = run_bounded([*command, *extra], cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    saved = json.loads((tmp_path / "run" / "vae" / "config.json").read_text())
    assert saved["scaling_factor"] == pytest.approx(0.23010)  # the recipe's latent scale travels with the VAE
    weights = load_file(tmp_path / "run" / "vae" / "diffusion_pytorch_model.safetensors")
    expected = load_file(repos.standalone / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


# What the Hub answers for a file that a repo does not have (huggingface_hub's error reads the response's headers).
NOT_FOUND = SimpleNamespace(headers={}, request=None)


def load_quietly(load, capfd):
    """`load()`, asserting that it warned of nothing and wrote nothing but progress bars to stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load()
    stderr = capfd.readouterr().err.replace("\r", "\n")
    assert not [line for line in stderr.splitlines() if line and "it/s]" not in line] and caught == []
    return loaded


def copy_with_tensors(folder: Path, target: Path, change) -> Path:
    """A copy of a model folder whose `model.safetensors` is `change(tensors)`."""
    shutil.copytree(folder, target)
    save_file(change(load_file(folder / "model.safetensors")), target / "model.safetensors")
    return target


@pytest.mark.parametrize("where", ["folder", "hub cache"])
def test_every_text_tensor_of_a_full_clip_checkpoint_loads_without_warnings(repos, offline_cache, where, capfd):
    given = resolve_text_encoder(source(repos, "clip", where), None)
    tokenizer, text_encoder = load_quietly(lambda: load_text_encoder(given), capfd)
    saved = load_file(repos.clip / "model.safetensors")
    state = text_encoder.state_dict()
    # Checkpoint names are the CLIPModel's (`text_model.…`); transformers 5 may drop that prefix in the model.
    names = {key: key if key in saved else f"text_model.{key}" for key in state}
    assert set(names.values()) <= saved.keys() and all(torch.equal(state[key], saved[names[key]]) for key in state)
    assert any(key.startswith("vision_model.") for key in saved)  # a whole CLIP checkpoint, as the Hub repo's
    assert tokenizer("a red circle").input_ids == CLIPTokenizer.from_pretrained(repos.clip)("a red circle").input_ids


@pytest.mark.parametrize("where", ["folder", "hub cache"])
@pytest.mark.parametrize("vae", VAE_LAYOUTS)
def test_the_vae_loads_its_safetensors_without_warnings(repos, offline_cache, vae, where, capfd):
    loaded = load_quietly(lambda: load_vae(resolve_vae(source(repos, vae, where), None)), capfd)
    folder = getattr(repos, vae) / VAE_LAYOUTS[vae].subfolder
    saved = load_file(folder / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(value, saved[key]) for key, value in loaded.state_dict().items())


def serve_from(folder: Path, monkeypatch) -> list[str]:
    """Answer `hf_hub_download` from `folder`, as the Hub would (a 404 for a file it lacks); returns the requests."""
    fetched = []

    def hf_hub_download(repo_id, filename, revision=None):
        fetched.append(filename)
        if not (folder / filename).is_file():
            raise huggingface_hub.errors.RemoteEntryNotFoundError(f"404 {filename}", response=NOT_FOUND)
        return str(folder / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    return fetched


def test_a_hub_text_encoder_fetches_only_its_config_tokenizer_and_safetensors(repos, monkeypatch):
    """Online, only the files the trainer reads: no .bin, .h5 or .msgpack, nor docs/coco.md's omitted tokenizer.json."""
    fetched = serve_from(repos.clip, monkeypatch)
    load_text_encoder(TextEncoderSource(CLIP_REPO, "", ""))
    assert fetched == ["config.json", "model.safetensors", *TOKENIZER_FILE_NAMES]


def test_sharded_weights_are_fetched_with_their_index(repos, tmp_path, monkeypatch):
    sharded = tmp_path / "sharded"
    shutil.copytree(repos.standalone, sharded)
    tensors = load_file(sharded / "diffusion_pytorch_model.safetensors")
    (sharded / "diffusion_pytorch_model.safetensors").unlink()
    names = sorted(tensors)
    halves = {f"diffusion_pytorch_model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for shard, keys in halves.items():
        save_file({key: tensors[key] for key in keys}, sharded / shard)
    weight_map = {key: shard for shard, keys in halves.items() for key in keys}
    (sharded / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    fetched = serve_from(sharded, monkeypatch)
    vae = load_vae(VaeSource(STANDALONE_VAE_REPO, ""))
    index = "diffusion_pytorch_model.safetensors.index.json"
    assert fetched == ["config.json", "diffusion_pytorch_model.safetensors", index, *halves]
    assert all(torch.equal(value, tensors[key]) for key, value in vae.state_dict().items())


def test_a_text_checkpoint_that_would_leave_tensors_random_or_holds_others_is_refused(
    script, repos, offline_cache, tmp_path
):
    without_norm = lambda t: {k: v for k, v in t.items() if "final_layer_norm" not in k}  # noqa: E731
    lacking = copy_with_tensors(repos.clip, tmp_path / "lacking", without_norm)
    with pytest.raises(ValueError) as error:
        load_text_encoder(resolve_text_encoder(str(lacking), None))
    # The names as transformers reports them (transformers 5 leaves out the checkpoint's "text_model." prefix).
    bias, weight = (rf"(text_model\.)?final_layer_norm\.{name}" for name in ("bias", "weight"))
    start = f"--pretrained_text_encoder {lacking}: the checkpoint lacks 2 of the CLIP text model's tensors ("
    end = "). Pass a CLIP text model or a full CLIP."
    assert re.fullmatch(f"{re.escape(start)}{bias}, {weight}{re.escape(end)}", str(error.value)), str(error.value)
    other = copy_with_tensors(repos.clip, tmp_path / "other", lambda t: {**t, "unet.conv.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"holds 1 tensors that are not a CLIP text model's \(unet\.conv\.weight\)"):
        load_text_encoder(resolve_text_encoder(str(other), None))
    args = script.parse_args(preset_args(repos, "coco-f2", tmp_path) + ["--pretrained_text_encoder", str(lacking)])
    with pytest.raises(SystemExit, match=r"^error: --pretrained_text_encoder .*lacking: the checkpoint lacks 2 "):
        components.load_components(args)
