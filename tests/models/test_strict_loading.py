"""A checkpoint fills every weight or is refused, on every loading path; saving or pushing writes no local path."""

import inspect
import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from diffusers.models.modeling_utils import ModelMixin
from diffusers.pipelines import pipeline_utils
from safetensors.torch import load_file, save_file
from test_models import make_inputs, make_model
from test_pipeline_loading import fill_hub_cache

from diffusers_lmlp import LMLPPipeline, LMLPTransformer2DModel, MoEMLPModel, UViTTransformer2DModel
from diffusers_lmlp.models.loading import is_local_path


NORM_WEIGHT = "stack.mid_block.token_norm.weight"  # a LayerNorm weight: a new model initialises it to ones
EXTRA = "stack.mid_block.extra.weight"
WEIGHTS = "diffusion_pytorch_model.safetensors"
# Every way diffusers reads a checkpoint: (save_pretrained arguments, from_pretrained arguments).
LOADING_PATHS = [({}, {}), ({}, {"low_cpu_mem_usage": False}), ({}, {"device_map": "cpu"})]
LOADING_PATHS += [({"max_shard_size": "20KB"}, {}), ({"max_shard_size": "20KB"}, {"low_cpu_mem_usage": False})]


def remove_tensor(folder: Path, key: str) -> None:
    for file in folder.glob("*.safetensors"):
        tensors = load_file(file)
        if tensors.pop(key, None) is not None:
            return save_file(tensors, file, metadata={"format": "pt"})
    raise AssertionError(f"no file in {folder} holds {key}")


def add_tensor_to(file: Path, key: str, tensor: torch.Tensor) -> None:
    save_file({**load_file(file), key: tensor}, file, metadata={"format": "pt"})


@pytest.mark.parametrize("save, load", LOADING_PATHS)
def test_a_missing_tensor_is_refused_on_every_loading_path(tmp_path, save, load):
    (model := make_model("lmlp")).save_pretrained(tmp_path, **save)
    loaded = LMLPTransformer2DModel.from_pretrained(tmp_path, **load)  # the intact checkpoint loads exactly
    torch.testing.assert_close(loaded.state_dict(), model.state_dict(), rtol=0, atol=0)
    remove_tensor(tmp_path, NORM_WEIGHT)
    message = rf"at {re.escape(str(tmp_path))} .*1 weight of the model is missing from it \({NORM_WEIGHT}\)\. "
    with pytest.raises(ValueError, match=message + r".*save it again with save_pretrained.*strict=False to LMLPTrans"):
        LMLPTransformer2DModel.from_pretrained(tmp_path, **load)


@pytest.mark.parametrize("model_class", [MoEMLPModel, UViTTransformer2DModel])
def test_a_folder_loaded_as_another_familys_class_is_refused_naming_both_classes(tmp_path, model_class):
    make_model("lmlp").save_pretrained(tmp_path)
    name = model_class.__name__
    expected = (
        rf"does not match the {name} it is loaded as: \d+ weights of the model are missing from it \(stack\.in_blocks"
        rf".*\d+ more\); \d+ tensors in it are not weights of the model .*Its config.json names the class "
        rf"LMLPTransformer2DModel, not {name}: load it with LMLPTransformer2DModel.from_pretrained\(...\).*strict=False"
    )
    with pytest.raises(ValueError, match=expected):
        model_class.from_pretrained(tmp_path)


@pytest.mark.parametrize("load", [{}, {"low_cpu_mem_usage": False}])
def test_an_extra_tensor_is_refused_and_strict_false_loads_with_a_warning_and_new_values(tmp_path, caplog, load):
    (model := make_model("lmlp")).save_pretrained(tmp_path)
    add_tensor_to(tmp_path / WEIGHTS, EXTRA, torch.ones(4, 4))
    with pytest.raises(ValueError, match=re.escape(f"1 tensor in it is not a weight of the model ({EXTRA})")):
        LMLPTransformer2DModel.from_pretrained(tmp_path, **load)
    remove_tensor(tmp_path, NORM_WEIGHT)
    with caplog.at_level(logging.WARNING, logger="diffusers_lmlp"):
        loaded, info = LMLPTransformer2DModel.from_pretrained(tmp_path, strict=False, output_loading_info=True, **load)
    [warning] = [r.message for r in caplog.records if r.name.startswith("diffusers_lmlp")]
    assert "with strict=False" in warning and f"1 weight of the model is missing from it ({NORM_WEIGHT})" in warning
    assert f"1 tensor in it is not a weight of the model ({EXTRA})" in warning
    assert (info["missing_keys"], info["unexpected_keys"]) == ([NORM_WEIGHT], [EXTRA])
    # Every other weight is the checkpoint's; the missing LayerNorm weight is a new model's: ones.
    model.get_parameter(NORM_WEIGHT).data.fill_(1.0)
    torch.testing.assert_close(loaded.state_dict(), model.state_dict(), rtol=0, atol=0)
    assert isinstance(loaded.get_parameter(NORM_WEIGHT), torch.nn.Parameter)


def test_weights_recreated_for_ignore_mismatched_sizes_get_a_new_models_values(tmp_path):
    make_model("lmlp").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mlp_ratio": 2.0}))
    loaded, info = LMLPTransformer2DModel.from_pretrained(
        tmp_path, ignore_mismatched_sizes=True, output_loading_info=True
    )
    recreated = sorted(key for key, *_ in info["mismatched_keys"])
    assert recreated and all(".joint_mlp." in key for key in recreated)
    # diffusers leaves them on the meta device (with low_cpu_mem_usage, its default); a new model's biases are 0.
    state = loaded.state_dict()
    assert not any(tensor.is_meta for tensor in state.values())
    assert all(torch.equal(state[key], torch.zeros_like(state[key])) for key in recreated if key.endswith(".bias"))
    assert torch.isfinite(loaded(*make_inputs()).sample).all()


@pytest.mark.parametrize("load", [{}, {"low_cpu_mem_usage": False}, {"device_map": "cpu"}])
def test_a_tensor_in_a_shard_the_index_does_not_assign_it_to_is_refused(tmp_path, load):
    make_model("lmlp").save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / f"{WEIGHTS}.index.json").read_text())["weight_map"]
    home = index[NORM_WEIGHT]
    other = next(shard for shard in sorted(set(index.values())) if shard != home)
    add_tensor_to(tmp_path / other, NORM_WEIGHT, torch.full_like(load_file(tmp_path / home)[NORM_WEIGHT], 7.0))
    with pytest.raises(ValueError, match=rf"The tensor {re.escape(NORM_WEIGHT)} is in two shards of one checkpoint"):
        LMLPTransformer2DModel.from_pretrained(tmp_path, **load)


class DiffusersLoading(LMLPTransformer2DModel):
    """The backbone as diffusers alone loads it: `ModelMixin`'s own `from_pretrained` and private loader."""

    from_pretrained = classmethod(ModelMixin.from_pretrained.__func__)
    _load_pretrained_model = classmethod(ModelMixin._load_pretrained_model.__func__)


def test_the_gaps_the_private_loader_override_closes_are_still_open_in_diffusers(tmp_path):
    """Canaries of models/loading.py's override: when one fails, its reason is gone."""
    parameters = " ".join(inspect.signature(ModelMixin._load_pretrained_model).parameters)
    assert parameters.startswith("model state_dict resolved_model_file pretrained_model_name_or_path loaded_keys")
    make_model("lmlp").save_pretrained(tmp_path / "whole")
    remove_tensor(tmp_path / "whole", NORM_WEIGHT)
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        DiffusersLoading.from_pretrained(tmp_path / "whole", device_map="cpu")
    # A tensor only the shard index lists: diffusers reports nothing missing.
    make_model("lmlp").save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    remove_tensor(tmp_path / "sharded", NORM_WEIGHT)
    _, info = DiffusersLoading.from_pretrained(tmp_path / "sharded", output_loading_info=True, low_cpu_mem_usage=False)
    assert info["missing_keys"] == []


def saved_text(folder: Path) -> dict[str, str]:
    files = [path for path in sorted(folder.rglob("*")) if path.is_file() and path.suffix in {".json", ".txt", ".md"}]
    return {path.relative_to(folder).as_posix(): path.read_text(encoding="utf-8") for path in files}


def configs(folder: Path) -> dict[str, dict]:
    names = ["model_index.json", *(p.relative_to(folder).as_posix() for p in folder.glob("*/*config.json"))]
    return {name: json.loads((folder / name).read_text()) for name in names if "tokenizer" not in name}


def test_a_loaded_pipeline_or_backbone_saves_and_pushes_no_path_of_this_machine(pipe, generate, tmp_path, monkeypatch):
    pipe.save_pretrained(tmp_path / "first")  # built in memory: nothing was loaded from anywhere
    loaded = LMLPPipeline.from_pretrained(tmp_path / "first")
    loaded.save_pretrained(tmp_path / "second")
    assert not [name for name, text in saved_text(tmp_path / "second").items() if str(tmp_path) in text]
    # Nothing else changed: every diffusers config reads as the one saved before the load, key for key.
    assert configs(tmp_path / "second") == configs(tmp_path / "first")
    # The pipeline in memory still knows where it came from, and the saved one loads and samples the same.
    assert loaded.name_or_path == str(tmp_path / "first")
    assert loaded.vae.config._name_or_path == str(tmp_path / "first" / "vae")  # what diffusers records
    again = LMLPPipeline.from_pretrained(tmp_path / "second")
    again.set_progress_bar_config(disable=True)
    torch.testing.assert_close(generate(again), generate(pipe), rtol=0, atol=0)
    backbone = LMLPTransformer2DModel.from_pretrained(tmp_path / "first", subfolder="transformer")
    backbone.save_pretrained(tmp_path / "backbone")
    assert "_name_or_path" not in json.loads((tmp_path / "backbone" / "config.json").read_text())
    # diffusers' own push, its Hub calls replaced; the upload reads the folder as it would be sent.
    uploaded = {}
    monkeypatch.setattr(pipeline_utils, "create_repo", lambda repo_id, **kwargs: SimpleNamespace(repo_id=repo_id))
    card = huggingface_hub.ModelCard("---\n---\n")
    monkeypatch.setattr(pipeline_utils, "load_or_create_model_card", lambda *args, **kwargs: card)
    upload = lambda self, folder, repo_id, **kwargs: uploaded.update(saved_text(Path(folder)))  # noqa: E731
    monkeypatch.setattr(LMLPPipeline, "_upload_folder", upload)
    loaded.transformer = torch.compile(loaded.transformer)  # diffusers saves the module inside
    loaded.save_pretrained(tmp_path / "push", push_to_hub=True, repo_id="user/tiny-lmlp")
    assert "model_index.json" in uploaded and "vae/config.json" in uploaded
    assert not [name for name, text in uploaded.items() if str(tmp_path) in text]


def test_a_pipeline_loaded_by_repo_id_saves_the_id_not_the_cache_and_local_paths(pipe, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    pipe.save_pretrained(tmp_path / "saved")
    fill_hub_cache(tmp_path / "saved", tmp_path / "cache", "user/tiny-lmlp")
    loaded = LMLPPipeline.from_pretrained("user/tiny-lmlp", cache_dir=tmp_path / "cache")
    assert str(tmp_path / "cache") in loaded.vae.config._name_or_path  # the snapshot, in this machine's cache
    loaded.save_pretrained(tmp_path / "again")
    texts = saved_text(tmp_path / "again")
    assert not [name for name, text in texts.items() if str(tmp_path) in text]
    assert json.loads(texts["model_index.json"])["_name_or_path"] == "user/tiny-lmlp"  # where it came from
    assert is_local_path("/home/user/models/vae")
    assert not any(map(is_local_path, ["stabilityai/sd-vae-ft-mse", "user/tiny-lmlp", None, 3]))
    (tmp_path / "lmlp-shapes").mkdir()  # a relative folder that exists here counts as local
    monkeypatch.chdir(tmp_path)
    assert is_local_path("lmlp-shapes") and not is_local_path("lmlp-other")
