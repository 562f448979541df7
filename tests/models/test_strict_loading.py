"""Strict loading: a checkpoint fills every weight or is refused, on every diffusers path; `strict=False` warns."""

import copy
import inspect
import json
import logging
import re
from pathlib import Path

import pytest
import torch
from diffusers.models.modeling_utils import ModelMixin
from safetensors.torch import load_file, save_file
from test_models import make_inputs, make_model

from diffusers_lmlp import LMLPTransformer2DModel, MoEMLPModel, UViTTransformer2DModel


NORM_WEIGHT = "stack.mid_block.token_norm.weight"  # a LayerNorm weight: a new model initialises it to ones
EXTRA = "stack.mid_block.extra.weight"
WEIGHTS = "diffusion_pytorch_model.safetensors"
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
        if tensors.pop(key, None) is not None:
            return save_file(tensors, file, metadata={"format": "pt"})
    raise AssertionError(f"no file in {folder} holds {key}")


def add_tensor_to(file: Path, key: str, tensor: torch.Tensor) -> None:
    save_file({**load_file(file), key: tensor}, file, metadata={"format": "pt"})


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
        f"model is missing from it ({NORM_WEIGHT}). The checkpoint is incomplete or from another model or version: "
        "save it again with save_pretrained. To load it anyway (missing weights new, other tensors dropped), pass "
        "strict=False to LMLPTransformer2DModel.from_pretrained"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        LMLPTransformer2DModel.from_pretrained(tmp_path, **load)


@pytest.mark.parametrize("model_class", [MoEMLPModel, UViTTransformer2DModel])
def test_a_folder_loaded_as_another_familys_class_is_refused_naming_both_classes(tmp_path, model_class):
    make_model("lmlp").save_pretrained(tmp_path)
    name = model_class.__name__
    expected = (
        rf"The checkpoint at {re.escape(str(tmp_path))} does not match the {name} it is loaded as: \d+ weights of the "
        r"model are missing from it \(stack\.in_blocks.*\d+ more\); \d+ tensors in it are not weights of the model .*"
        rf"Its config.json names the class LMLPTransformer2DModel, not {name}: load it with "
        rf"LMLPTransformer2DModel.from_pretrained\(...\).*pass strict=False to {name}.from_pretrained"
    )
    with pytest.raises(ValueError, match=expected):
        model_class.from_pretrained(tmp_path)


@pytest.mark.parametrize("load", [{}, {"low_cpu_mem_usage": False}], ids=["default", "low_cpu_mem_usage=False"])
def test_an_extra_tensor_is_refused_and_strict_false_loads_with_a_warning_and_new_values(tmp_path, caplog, load):
    model = make_model("lmlp")
    model.save_pretrained(tmp_path)
    add_tensor_to(tmp_path / WEIGHTS, EXTRA, torch.ones(4, 4))
    with pytest.raises(ValueError, match=re.escape(f"1 tensor in it is not a weight of the model ({EXTRA})")):
        LMLPTransformer2DModel.from_pretrained(tmp_path, **load)
    remove_tensor(tmp_path, NORM_WEIGHT)

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
    assert torch.isfinite(outputs(loaded)).all()


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
