"""Saving and loading `LMLPPipeline` the diffusers ways, offline: local folders, the Hub cache, dtypes, variants."""

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from diffusers import (
    AutoPipelineForImage2Image,
    AutoPipelineForInpainting,
    AutoPipelineForText2Image,
    DiffusionPipeline,
    EulerDiscreteScheduler,
)
from safetensors.torch import load_file, save_file
from test_pipeline import NATIVE

from diffusers_lmlp import FAMILIES, LMLPPipeline, LMLPTransformer2DModel
from diffusers_lmlp.hub import stage_pipeline
from diffusers_lmlp.pipelines import loading as pipeline_loading


pytestmark = pytest.mark.usefixtures("no_unpickling")

BACKBONES = {name: family.model_class for name, family in FAMILIES.items()}
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fill_hub_cache(folder: Path, cache_dir: Path, repo_id: str, listed_but_not_cached: tuple[str, ...] = ()) -> None:
    """Cache `folder` as huggingface_hub's snapshot of `repo_id` at `COMMIT`; `listed_but_not_cached`: listed only."""
    storage = cache_dir / f"models--{repo_id.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(COMMIT)
    listing = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative, data = path.relative_to(folder).as_posix(), path.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(exist_ok=True)
        blob.write_bytes(data)
        link = storage / "snapshots" / COMMIT / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
        listing[relative] = {"size": len(data), "blob_id": hashlib.sha1(data).hexdigest()}
    listing |= {relative: {"size": 1, "blob_id": "0" * 40} for relative in listed_but_not_cached}
    (storage / "trees").mkdir()
    (storage / "trees" / f"{COMMIT}.json").write_text(json.dumps({"format_version": 1, "files": listing}))


def loaded_samples_like(loaded: DiffusionPipeline, pipe: LMLPPipeline, generate) -> None:
    assert type(loaded) is LMLPPipeline
    loaded.set_progress_bar_config(disable=True)
    torch.testing.assert_close(generate(loaded), generate(pipe), rtol=0, atol=0)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_every_backbone_samples_guided_saves_safetensors_and_loads(make_pipe, generate, tmp_path, backbone):
    pipe = make_pipe(backbone)
    guided = generate(pipe, guidance_scale=3.0)
    assert guided.shape == (1, 3, NATIVE, NATIVE)
    assert torch.isfinite(guided).all() and guided.min() >= 0 and guided.max() <= 1
    assert not torch.allclose(guided, generate(pipe, guidance_scale=1.0))
    pipe.save_pretrained(tmp_path)
    model_index = json.loads((tmp_path / "model_index.json").read_text())
    assert model_index["_class_name"] == "LMLPPipeline"
    assert model_index["transformer"] == ["diffusers_lmlp", BACKBONES[backbone].__name__]
    weights = [p.name for p in tmp_path.rglob("*") if p.suffix in {".safetensors", ".bin", ".pt", ".pth", ".ckpt"}]
    assert sorted(weights) == ["diffusion_pytorch_model.safetensors"] * 2 + ["model.safetensors"]
    loaded = LMLPPipeline.from_pretrained(tmp_path)
    model = BACKBONES[backbone].from_pretrained(tmp_path, subfolder="transformer")
    assert isinstance(loaded.transformer, BACKBONES[backbone])
    # `import diffusers_lmlp` registered LMLPPipeline on the diffusers namespace.
    for o in (loaded, DiffusionPipeline.from_pretrained(tmp_path), LMLPPipeline.from_pipe(pipe, transformer=model)):
        loaded_samples_like(o, pipe, generate)
    # diffusers' own `from_pipe` leaves out a backbone whose class is not the annotated `ModelMixin`.
    view = LMLPPipeline.from_pipe(pipe, scheduler=EulerDiscreteScheduler.from_config(pipe.scheduler.config))
    view.set_progress_bar_config(disable=True)
    assert all(getattr(view, n) is getattr(pipe, n) for n in ("transformer", "vae", "text_encoder", "tokenizer"))
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    torch.testing.assert_close(generate(view), generate(pipe), rtol=0, atol=0)


def test_a_hub_repo_and_the_text2image_auto_pipeline_load(pipe, generate, tmp_path, monkeypatch):
    # The Hub cache holds `pipe` as `user/tiny-lmlp`, offline, listing pickled and variant weights it lacks.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    pipe.save_pretrained(tmp_path / "saved")
    not_cached = ("transformer/diffusion_pytorch_model.bin", "vae/diffusion_pytorch_model.fp16.safetensors")
    fill_hub_cache(tmp_path / "saved", tmp_path / "cache", "user/tiny-lmlp", listed_but_not_cached=not_cached)
    loaded = LMLPPipeline.from_pretrained("user/tiny-lmlp", cache_dir=tmp_path / "cache")
    assert loaded.name_or_path == "user/tiny-lmlp"
    loaded_samples_like(loaded, pipe, generate)
    # diffusers 0.42 refuses components of third-party libraries from the Hub.
    with pytest.raises(ValueError, match="transformer/diffusers_lmlp.py .* does not exist"):
        DiffusionPipeline.from_pretrained("user/tiny-lmlp", cache_dir=tmp_path / "cache")
    # diffusers' auto pipelines find a class in their task mappings, where `import diffusers_lmlp` enters it.
    for loaded in (
        AutoPipelineForText2Image.from_pretrained(tmp_path / "saved"),
        AutoPipelineForText2Image.from_pretrained("user/tiny-lmlp", cache_dir=tmp_path / "cache"),
        AutoPipelineForText2Image.from_pipe(pipe),
    ):
        assert isinstance(loaded.transformer, LMLPTransformer2DModel)
        loaded_samples_like(loaded, pipe, generate)
    assert all(c is pipe.components[n] for n, c in AutoPipelineForText2Image.from_pipe(pipe).components.items())
    for auto_pipeline in (AutoPipelineForImage2Image, AutoPipelineForInpainting):
        for load in (lambda: auto_pipeline.from_pretrained(tmp_path / "saved"), lambda: auto_pipeline.from_pipe(pipe)):
            with pytest.raises(ValueError, match="can't find a pipeline linked to LMLPPipeline"):
                load()
    # A folder pushed with code names its own code, which auto pipelines cannot resolve (docs/pipeline.md).
    folder = stage_pipeline(tmp_path / "saved", "alice/tiny-lmlp", tmp_path / "with-code", with_code=True).folder
    with pytest.raises(ValueError, match=r"can't find a pipeline linked to \['pipeline_lmlp', 'LMLPPipeline'\]"):
        AutoPipelineForText2Image.from_pretrained(folder)
    loaded_samples_like(LMLPPipeline.from_pretrained(folder), pipe, generate)


def test_dtype_torch_dtype_and_per_component_dtype(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    with pytest.warns(FutureWarning, match="dtype"):
        old_name = LMLPPipeline.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    for loaded in (LMLPPipeline.from_pretrained(tmp_path, dtype=torch.bfloat16), old_name):
        assert {loaded.transformer.dtype, loaded.text_encoder.dtype, loaded.vae.dtype} == {torch.bfloat16}
    loaded = LMLPPipeline.from_pretrained(tmp_path, dtype={"transformer": torch.bfloat16, "default": torch.float32})
    loaded.set_progress_bar_config(disable=True)
    assert (loaded.transformer.dtype, loaded.text_encoder.dtype) == (torch.bfloat16, torch.float32)
    assert torch.isfinite(loaded("a red circle", num_inference_steps=2, output_type="pt").images).all()


@pytest.mark.slow
def test_variant_round_trip(pipe, generate, tmp_path):
    pipe.to(torch.bfloat16)
    pipe.save_pretrained(tmp_path, variant="bf16")
    assert (tmp_path / "transformer" / "diffusion_pytorch_model.bf16.safetensors").is_file()
    loaded_samples_like(LMLPPipeline.from_pretrained(tmp_path, variant="bf16", dtype=torch.bfloat16), pipe, generate)
    with pytest.raises(OSError, match=r"no file named (diffusion_pytorch_)?model.safetensors"):
        LMLPPipeline.from_pretrained(tmp_path)


def test_pickled_weights_and_missing_components_are_refused_but_other_pickles_are_not(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "pickled", safe_serialization=False)
    with pytest.raises(ValueError, match=r"transformer holds only pickled weights \(diffusion_pytorch_model.bin\)"):
        LMLPPipeline.from_pretrained(tmp_path / "pickled")
    with pytest.raises(ValueError, match="use_safetensors=False"):
        LMLPPipeline.from_pretrained(tmp_path / "pickled", use_safetensors=False)
    pipe.save_pretrained(tmp_path / "run")  # a training run's output folder, with accelerate checkpoints beside it
    (tmp_path / "run" / "checkpoint-500").mkdir()
    (tmp_path / "run" / "checkpoint-500" / "optimizer.bin").write_bytes(b"not read")
    assert isinstance(LMLPPipeline.from_pretrained(tmp_path / "run"), LMLPPipeline)
    pipe.save_pretrained(tmp_path / "broken")
    for name in ("tokenizer.json", "vocab.json"):
        (tmp_path / "broken" / "tokenizer" / name).unlink(missing_ok=True)
    # What is left, tokenizer_config.json, transformers would load as an empty tokenizer.
    assert (tmp_path / "broken" / "tokenizer" / "tokenizer_config.json").is_file()
    with pytest.raises(ValueError, match=r"tokenizer folder .* has neither tokenizer.json nor vocab.json"):
        LMLPPipeline.from_pretrained(tmp_path / "broken")
    shutil.rmtree(tmp_path / "broken" / "tokenizer")
    # Not the `model_max_length=1e30` mismatch of the empty tokenizer transformers would build.
    with pytest.raises(ValueError, match=r"has no tokenizer/ folder, but its model_index.json names the tokenizer"):
        LMLPPipeline.from_pretrained(tmp_path / "broken")
    assert LMLPPipeline.from_pretrained(tmp_path / "broken", tokenizer=pipe.tokenizer).tokenizer is pipe.tokenizer


def test_a_pipeline_whose_transformer_misses_a_tensor_is_refused_by_both_loaders(pipe, tmp_path):
    pipe.save_pretrained(tmp_path)
    file = tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(file)
    key = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != key}, file, metadata={"format": "pt"})
    refusal = re.escape(
        f"The checkpoint at {tmp_path / 'transformer'} does not match the LMLPTransformer2DModel it is loaded as: 1 "
        f"weight of the model is missing from it ({key})."
    )
    for loader in (LMLPPipeline, DiffusionPipeline):
        with pytest.raises(ValueError, match=refusal):
            loader.from_pretrained(tmp_path)
    # diffusers passes no `strict` to a component: the pipeline says how to load such a transformer instead ...
    with pytest.raises(ValueError, match=re.escape("LMLPTransformer2DModel.from_pretrained(") + ".*strict=False"):
        LMLPPipeline.from_pretrained(tmp_path, strict=False)
    # ... and that way loads it, with every weight but the missing one from the checkpoint.
    transformer = LMLPTransformer2DModel.from_pretrained(tmp_path, subfolder="transformer", strict=False)
    assert LMLPPipeline.from_pretrained(tmp_path, transformer=transformer).transformer is transformer
    saved = pipe.transformer.state_dict()
    assert all(torch.equal(value, saved[name]) for name, value in transformer.state_dict().items() if name != key)


# A Path is never taken for a repo id, though "mistyped" would be a valid one; a file is not taken for a folder.
@pytest.mark.parametrize(
    "name", ["./mistyped", "~/mistyped", "outputs/run/mistyped", "C:\\mistyped", Path("mistyped"), "model_index.json"]
)
def test_a_mistyped_folder_or_a_file_is_reported_as_no_such_local_folder(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model_index.json").write_text("{}")
    error, message = (FileNotFoundError, f"No such local folder: {name}")
    if name == "model_index.json":
        error, message = (NotADirectoryError, "model_index.json is a file; pass the pipeline's folder")
    with pytest.raises(error, match=re.escape(message)) as missing:
        LMLPPipeline.from_pretrained(name)
    assert missing.value.__context__ is None  # one error, not a Hub traceback inside another


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "local_files_only"])
def test_a_repo_id_missing_from_the_cache_is_one_clear_error_offline(tmp_path, monkeypatch, offline):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.chdir(tmp_path)
    expected = (
        f"No such local folder: a-mistyped-folder (there is no {tmp_path / 'a-mistyped-folder'}), and the Hub repo's "
        f"copy in the cache {tmp_path / 'cache'} is missing (offline): run `hf download a-mistyped-folder --cache-dir "
        f"{tmp_path / 'cache'}` where the Hub can be reached, or pass a local folder."
    )
    with pytest.raises(huggingface_hub.errors.LocalEntryNotFoundError, match=f"^{re.escape(expected)}$") as missing:
        LMLPPipeline.from_pretrained("a-mistyped-folder", cache_dir=tmp_path / "cache", local_files_only=not offline)
    assert missing.value.__cause__ is None and missing.value.__suppress_context__


def not_on_the_hub(repo_id, **kwargs):  # the Hub's answer to an unknown repo id (the error needs a response's headers)
    raise huggingface_hub.errors.RepositoryNotFoundError(repo_id, response=SimpleNamespace(headers={}, request=None))


def test_a_repo_id_that_the_hub_does_not_have_is_named_as_neither_folder_nor_repo(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline_loading, "snapshot_download", not_on_the_hub)  # online only
    monkeypatch.chdir(tmp_path)
    expected = f"No such local folder: user/mistyped (there is no {tmp_path / 'user' / 'mistyped'}), and no Hub repo"
    with pytest.raises(FileNotFoundError, match=re.escape(expected)) as missing:
        LMLPPipeline.from_pretrained("user/mistyped")
    assert missing.value.__suppress_context__
