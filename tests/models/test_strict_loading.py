"""Strict loading: a checkpoint fills every weight or is refused, on every diffusers path; `strict=False` warns."""

import copy
import inspect
import json
import logging
import re
from pathlib import Path

import pytest
import safetensors
import torch
from diffusers.models.modeling_utils import ModelMixin
from safetensors.torch import load_file, save_file
from test_models import make_inputs, make_model

from diffusers_lmlp import LMLPTransformer2DModel, MoEMLPModel, UViTTransformer2DModel


# A LayerNorm weight: a new model initialises it to ones.
NORM_WEIGHT = "stack.mid_block.token_norm.weight"
EXTRA = "stack.mid_block.extra.weight"
# Every way diffusers reads a checkpoint: (save_pretrained arguments, from_pretrained arguments).
LOADING_PATHS = {
    "default": ({}, {}),
    "low_cpu_mem_usage=False": ({}, {"low_cpu_mem_usage": False}),
    "device_map": ({}, {"device_map": "cpu"}),
    "sharded": ({"max_shard_size": "20KB"}, {}),
    "sharded, low_cpu_mem_usage=False": ({"max_shard_size": "20KB"}, {"low_cpu_mem_usage": False}),
}


def remove_tensor(folder: Path, key: str) -> None:
    for file in folder.glob("*.safetensors"):
        tensors = load_file(file)
        if key in tensors:
            del tensors[key]
            save_file(tensors, file, metadata={"format": "pt"})
            return
    raise AssertionError(f"no file in {folder} holds {key}")


def named(keys: set[str]) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def outputs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(*make_inputs()).sample


@pytest.mark.parametrize("save, load", LOADING_PATHS.values(), ids=LOADING_PATHS)
def test_a_missing_tensor_is_refused_on_every_loading_path(tmp_path, save, load):
    model = make_model("lmlp")
    model.save_pretrained(tmp_path, **save)
    # The intact checkpoint loads exactly.
    torch.testing.assert_close(
        outputs(LMLPTransformer2DModel.from_pretrained(tmp_path, **load)), outputs(model), rtol=0, atol=0
    )

    remove_tensor(tmp_path, NORM_WEIGHT)
    expected = (
        f"The checkpoint at {tmp_path} does not match the LMLPTransformer2DModel it is loaded as: 1 weight of the "
        f"model is missing from it ({NORM_WEIGHT}). The checkpoint is incomplete, or was written by another model or "
        "version than the LMLPTransformer2DModel its config.json describes: save it again from the trained model "
        "with save_pretrained. To load it anyway, with the missing weights initialised as in a new model and the "
        "other tensors dropped, pass strict=False to LMLPTransformer2DModel.from_pretrained"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        LMLPTransformer2DModel.from_pretrained(tmp_path, **load)


@pytest.mark.parametrize("model_class", [MoEMLPModel, UViTTransformer2DModel])
def test_a_folder_loaded_as_another_familys_class_is_refused_naming_both_classes(tmp_path, model_class):
    make_model("lmlp").save_pretrained(tmp_path)
    with safetensors.safe_open(tmp_path / "diffusion_pytorch_model.safetensors", "pt") as file:
        in_file = set(file.keys())
    config = json.loads((tmp_path / "config.json").read_text())
    arguments = inspect.signature(model_class.__init__).parameters
    in_model = set(model_class(**{k: v for k, v in config.items() if k in arguments}).state_dict())
    missing, unexpected = in_model - in_file, in_file - in_model

    expected = (
        f"The checkpoint at {tmp_path} does not match the {model_class.__name__} it is loaded as: {len(missing)} "
        f"weights of the model are missing from it ({named(missing)}); {len(unexpected)} tensors in it are not "
        f"weights of the model ({named(unexpected)}). Its config.json names the class LMLPTransformer2DModel, not "
        f"{model_class.__name__}: load it with the class in config.json, LMLPTransformer2DModel.from_pretrained(...)"
    )
    with pytest.raises(ValueError, match=re.escape(expected)) as refused:
        model_class.from_pretrained(tmp_path)
    assert f"pass strict=False to {model_class.__name__}.from_pretrained" in str(refused.value)


def test_a_tensor_the_model_does_not_have_is_refused(tmp_path):
    make_model("lmlp").save_pretrained(tmp_path)
    add_tensor_to(tmp_path / "diffusion_pytorch_model.safetensors", EXTRA, torch.ones(4, 4))
    with pytest.raises(ValueError, match=re.escape(f"1 tensor in it is not a weight of the model ({EXTRA})")):
        LMLPTransformer2DModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("load", [{}, {"low_cpu_mem_usage": False}], ids=["default", "low_cpu_mem_usage=False"])
def test_strict_false_loads_with_a_warning_and_a_new_models_values_for_the_missing_weights(tmp_path, caplog, load):
    model = make_model("lmlp")
    model.save_pretrained(tmp_path)
    remove_tensor(tmp_path, NORM_WEIGHT)
    add_tensor_to(tmp_path / "diffusion_pytorch_model.safetensors", EXTRA, torch.ones(4, 4))

    with caplog.at_level(logging.WARNING, logger="diffusers_lmlp"):
        loaded, info = LMLPTransformer2DModel.from_pretrained(tmp_path, strict=False, output_loading_info=True, **load)
    warnings = [r.message for r in caplog.records if r.name.startswith("diffusers_lmlp")]
    assert len(warnings) == 1 and "with strict=False" in warnings[0]
    assert f"1 weight of the model is missing from it ({NORM_WEIGHT})" in warnings[0]
    assert f"1 tensor in it is not a weight of the model ({EXTRA})" in warnings[0]
    assert (info["missing_keys"], info["unexpected_keys"]) == ([NORM_WEIGHT], [EXTRA])

    # Every other weight is the checkpoint's; the missing LayerNorm weight is a new model's: ones.
    expected = copy.deepcopy(model)
    with torch.no_grad():
        expected.get_parameter(NORM_WEIGHT).fill_(1.0)
    torch.testing.assert_close(loaded.state_dict(), expected.state_dict(), rtol=0, atol=0)
    assert isinstance(loaded.get_parameter(NORM_WEIGHT), torch.nn.Parameter)
    torch.testing.assert_close(outputs(loaded), outputs(expected), rtol=0, atol=0)


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
    assert not any(tensor.is_meta for tensor in loaded.state_dict().values())
    for key in recreated:
        if key.endswith(".bias"):
            assert torch.equal(loaded.state_dict()[key], torch.zeros_like(loaded.state_dict()[key]))
    assert torch.isfinite(outputs(loaded)).all()


def test_use_flashpack_is_refused_because_only_safetensors_are_read(tmp_path):
    make_model("lmlp").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="safetensors weights only, whose keys it checks.*use_flashpack=True"):
        LMLPTransformer2DModel.from_pretrained(tmp_path, use_flashpack=True)


class DiffusersLoading(LMLPTransformer2DModel):
    """The backbone as diffusers alone loads it: `ModelMixin`'s own `from_pretrained` and private loader."""

    from_pretrained = classmethod(ModelMixin.from_pretrained.__func__)
    _load_pretrained_model = classmethod(ModelMixin._load_pretrained_model.__func__)


# Canaries of the override of diffusers' private loader (models/loading.py): when one fails, its reason is gone.
def test_diffusers_alone_fails_on_a_missing_tensor_with_a_device_map(tmp_path):
    make_model("lmlp").save_pretrained(tmp_path)
    remove_tensor(tmp_path, NORM_WEIGHT)
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        DiffusersLoading.from_pretrained(tmp_path, device_map="cpu")


@pytest.mark.parametrize("load", [{}, {"low_cpu_mem_usage": False}, {"device_map": "cpu"}])
def test_a_tensor_in_a_shard_the_index_does_not_assign_it_to_is_refused(tmp_path, load):
    make_model("lmlp").save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"]
    home = index[NORM_WEIGHT]
    other = next(shard for shard in sorted(set(index.values())) if shard != home)
    add_tensor_to(tmp_path / other, NORM_WEIGHT, torch.full_like(load_file(tmp_path / home)[NORM_WEIGHT], 7.0))
    with pytest.raises(ValueError, match=rf"The tensor {re.escape(NORM_WEIGHT)} is in two shards of one checkpoint"):
        LMLPTransformer2DModel.from_pretrained(tmp_path, **load)


def add_tensor_to(file: Path, key: str, tensor: torch.Tensor) -> None:
    save_file({**load_file(file), key: tensor}, file, metadata={"format": "pt"})


def test_diffusers_alone_reports_nothing_missing_for_a_tensor_only_the_shard_index_lists(tmp_path):
    make_model("lmlp").save_pretrained(tmp_path, max_shard_size="20KB")
    remove_tensor(tmp_path, NORM_WEIGHT)
    _, info = DiffusersLoading.from_pretrained(tmp_path, output_loading_info=True, low_cpu_mem_usage=False)
    assert info["missing_keys"] == []


def test_the_overridden_private_loader_has_the_signature_diffusers_calls():
    parameters = list(inspect.signature(ModelMixin._load_pretrained_model).parameters)
    assert parameters[:5] == [
        "model",
        "state_dict",
        "resolved_model_file",
        "pretrained_model_name_or_path",
        "loaded_keys",
    ]
