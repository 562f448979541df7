"""`LMLPPipeline` LoRA files, the diffusers way: save, load (folder, file, Hub cache), fuse, scale, combine, unload.

A loaded adapter is checked against W + weight·(alpha/r)·B·A computed by hand from the file's tensors, without peft.
Pickles are never opened, and no key of a file is skipped silently.
"""

import copy
import json
import os
import pickle
import re
from pathlib import Path

import huggingface_hub
import pytest
import safetensors.torch
import torch
from diffusers.loaders.lora_pipeline import SanaLoraLoaderMixin
from peft import LoraConfig, get_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file
from test_pipeline_loading import fill_hub_cache
from torch import nn

from diffusers_lmlp import FAMILIES, LMLPPipeline


pytestmark = pytest.mark.usefixtures("no_unpickling")

WEIGHT_NAME = "pytorch_lora_weights.safetensors"
# An adapter on nn.Linear layers (diffusers' own loading path) and one on tied weights (peft's target_parameters).
LINEAR_AND_TIED = ["lmlp", "symmixer"]


def blocks(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if re.fullmatch(r"stack\.(mid_block|(in|out)_blocks\.\d+)", n)}


def block_targets(model: nn.Module) -> tuple[list[str], list[str]]:
    """A block's nn.Linear names (`target_modules`) and tied 2-D weights without one (`target_parameters`)."""
    modules, parameters = set(), set()
    for block in blocks(model).values():
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear):
                modules.add(name)
            elif name and not isinstance(module, nn.LayerNorm):
                parameters.update(f"{name}.{p}" for p, v in module.named_parameters(recurse=False) if v.ndim == 2)
    return sorted(modules), sorted(parameters)


def write_lora(make_pipe, folder: Path, family: str = "lmlp", seed: int = 1, **overrides) -> LMLPPipeline:
    """Save a random adapter on every block layer as the trainer does (r=2, alpha=4: a loader ignoring alpha is off
    by 2×); return the pipeline holding it."""
    pipe = make_pipe(family)
    modules, parameters = block_targets(pipe.transformer)
    config = dict(r=2, lora_alpha=4, target_modules=modules, target_parameters=parameters, init_lora_weights=False)
    config = LoraConfig(**{**config, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe.transformer.add_adapter(config)
    LMLPPipeline.save_lora_weights(
        folder,
        transformer_lora_layers=get_peft_model_state_dict(pipe.transformer),
        transformer_lora_adapter_metadata=config.to_dict(),
    )
    return pipe


def unwrapped(layer: str) -> str:  # peft's wrappers insert `base_layer`
    return ".".join(part for part in layer.split(".") if part != "base_layer")


def file_layers(folder: Path) -> set[str]:
    return {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in load_file(folder / WEIGHT_NAME)}


def merged_by_hand(pipe: LMLPPipeline, *adapters: tuple[Path, float]) -> LMLPPipeline:
    """`pipe` with W + weight·(alpha/r)·B·A of each LoRA file added to a copy of its weights, read with safetensors."""
    transformer = copy.deepcopy(pipe.transformer)
    with torch.no_grad():
        for folder, weight in adapters:
            tensors = load_file(folder / WEIGHT_NAME)
            with safetensors.safe_open(folder / WEIGHT_NAME, "pt") as file:
                config = json.loads(file.metadata()["lora_adapter_metadata"])
            for layer in file_layers(folder):
                down = tensors[f"transformer.{layer}.lora_A.weight"]  # (r, in)
                up = tensors[f"transformer.{layer}.lora_B.weight"]  # (out, r)
                pattern = [a for p, a in config["transformer.alpha_pattern"].items() if unwrapped(layer).endswith(p)]
                alpha = pattern[0] if pattern else config["transformer.lora_alpha"]
                transformer.get_submodule(unwrapped(layer)).weight += weight * alpha / down.shape[0] * up @ down
    merged = LMLPPipeline(**{**pipe.components, "transformer": transformer})
    merged.set_progress_bar_config(disable=True)
    return merged


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def has_lora_layers(pipe: LMLPPipeline) -> bool:
    return any(isinstance(module, BaseTunerLayer) for module in pipe.transformer.modules())


def assert_refused_and_unchanged(pipe: LMLPPipeline, generate, load, message: str) -> None:
    base = generate(pipe)
    with pytest.raises(ValueError, match=message):
        load()
    assert pipe.get_list_adapters() == {} and not has_lora_layers(pipe)
    torch.testing.assert_close(generate(pipe), base, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_saved_lora_loads_to_the_hand_merged_weights_on_every_layer(make_pipe, generate, tmp_path, family):
    in_memory = write_lora(make_pipe, tmp_path, family)
    pipe = make_pipe(family)
    base = generate(pipe)
    pipe.load_lora_weights(tmp_path, adapter_name="style")
    # The file has every adaptable layer of every block, and the loaded adapter adapts exactly the file's layers.
    fresh = make_pipe(family).transformer
    modules, parameters = block_targets(fresh)
    names = {name for name, _ in fresh.named_modules()}
    targets = [*modules, *(parameter.rsplit(".", 1)[0] for parameter in parameters)]
    every_layer = {f"{b}.{t}" for b in blocks(fresh) for t in targets if f"{b}.{t}" in names}
    assert {unwrapped(layer) for layer in file_layers(tmp_path)} == every_layer
    adapted = {n for n, m in pipe.transformer.named_modules() if isinstance(m, BaseTunerLayer) and "style" in m.lora_A}
    assert adapted == file_layers(tmp_path)
    loaded = generate(pipe)
    assert (loaded - base).abs().max() > 1e-3, "the adapter does not change the image"
    torch.testing.assert_close(loaded, generate(in_memory), rtol=0, atol=0)
    close(loaded, generate(merged_by_hand(make_pipe(family), (tmp_path, 1.0))))
    # diffusers looks adapter weights up per model class; ours, unlisted, take them as given.
    pipe.set_adapters("style", adapter_weights=0.5)
    close(generate(pipe), generate(merged_by_hand(make_pipe(family), (tmp_path, 0.5))))


def test_rank_and_alpha_patterns_round_trip_exactly(make_pipe, generate, tmp_path):
    patterns = dict(rank_pattern={"joint_mlp.fc1": 3}, alpha_pattern={"merge": 8, "joint_mlp.fc1": 1})
    in_memory = write_lora(make_pipe, tmp_path, **patterns)
    pipe = make_pipe()
    pipe.load_lora_weights(tmp_path, adapter_name="style")
    saved, loaded = in_memory.transformer.peft_config["default"], pipe.transformer.peft_config["style"]
    for field in ("r", "lora_alpha", "rank_pattern", "alpha_pattern", "target_modules", "use_rslora", "use_dora"):
        assert getattr(loaded, field) == getattr(saved, field), field
    assert pipe.transformer.stack.mid_block.joint_mlp.fc1.lora_A["style"].weight.shape == (3, 32)
    assert pipe.transformer.stack.mid_block.merge.scaling["style"] == 8 / 2
    close(generate(pipe), generate(merged_by_hand(make_pipe(), (tmp_path, 1.0))))


def test_the_file_is_what_diffusers_writes_and_diffusers_reads_it(make_pipe, generate, tmp_path):
    adapted = write_lora(make_pipe, tmp_path / "ours")
    layers, config = get_peft_model_state_dict(adapted.transformer), adapted.transformer.peft_config["default"]
    # diffusers writes a set in the order it iterates it: give it the sorted list ours writes.
    metadata = {**config.to_dict(), "target_modules": sorted(config.target_modules)}
    SanaLoraLoaderMixin.save_lora_weights(
        tmp_path / "diffusers", transformer_lora_layers=layers, transformer_lora_adapter_metadata=metadata
    )
    # The same header entries and tensors (safetensors writes header entries in no fixed order: not bytes).
    written = {}
    for writer in ("ours", "diffusers"):
        with safetensors.safe_open(tmp_path / writer / WEIGHT_NAME, "pt") as file:
            written[writer] = file.metadata(), {key: file.get_tensor(key) for key in file.keys()}
    assert written["ours"][0] == written["diffusers"][0]
    assert written["ours"][0]["lora_adapter_metadata"] == json.dumps(
        {f"transformer.{k}": v for k, v in metadata.items()}, indent=2, sort_keys=True
    )
    assert sorted(written["ours"][1]) == sorted(written["diffusers"][1]) == sorted(f"transformer.{k}" for k in layers)
    assert all(torch.equal(value, written["diffusers"][1][key]) for key, value in written["ours"][1].items())

    ours = LMLPPipeline.lora_state_dict(tmp_path / "ours", return_lora_metadata=True)
    theirs = SanaLoraLoaderMixin.lora_state_dict(tmp_path / "ours", return_lora_metadata=True)
    assert ours[1] == theirs[1] and ours[1]["transformer.r"] == 2 and ours[1]["transformer.lora_alpha"] == 4
    assert sorted(ours[0]) == sorted(theirs[0]) and all(torch.equal(ours[0][k], theirs[0][k]) for k in ours[0])

    # diffusers' own model loader, given our file, adapts the transformer the same way.
    by_diffusers, by_us = make_pipe(), make_pipe()
    by_diffusers.transformer.load_lora_adapter(tmp_path / "ours", weight_name=WEIGHT_NAME, use_safetensors=True)
    by_us.load_lora_weights(tmp_path / "ours")
    torch.testing.assert_close(generate(by_us), generate(by_diffusers), rtol=0, atol=0)


def test_a_file_a_state_dict_and_a_hub_repo_load_like_the_folder(make_pipe, generate, tmp_path, monkeypatch):
    write_lora(make_pipe, tmp_path / "lora")
    from_folder, from_file, from_dict, from_hub = make_pipe(), make_pipe(), make_pipe(), make_pipe()
    from_folder.load_lora_weights(tmp_path / "lora")
    expected = generate(from_folder)
    from_file.load_lora_weights(tmp_path / "lora" / WEIGHT_NAME)
    state_dict, metadata = LMLPPipeline.lora_state_dict(tmp_path / "lora", return_lora_metadata=True)
    LMLPPipeline.load_lora_into_transformer(state_dict, from_dict.transformer, metadata=metadata)
    fill_hub_cache(tmp_path / "lora", tmp_path / "hub", "someone/tiny-lmlp-lora")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    from_hub.load_lora_weights("someone/tiny-lmlp-lora", adapter_name="hub")
    for pipe in (from_file, from_dict, from_hub):
        torch.testing.assert_close(generate(pipe), expected, rtol=0, atol=0)
    with pytest.raises(huggingface_hub.errors.LocalEntryNotFoundError):
        make_pipe().load_lora_weights("someone/not-in-the-cache")
    # A state dict alone carries no config: alpha = r (scale 1, half the saved alpha's), as in diffusers.
    without_metadata = make_pipe()
    without_metadata.load_lora_weights(state_dict)
    close(generate(without_metadata), generate(merged_by_hand(make_pipe(), (tmp_path / "lora", 0.5))))


def test_weight_name_and_subfolder_choose_the_file_and_misplaced_options_are_refused(make_pipe, tmp_path):
    write_lora(make_pipe, tmp_path / "default")
    (tmp_path / "repo" / "loras").mkdir(parents=True)
    (tmp_path / "default" / WEIGHT_NAME).rename(tmp_path / "repo" / "loras" / "style.safetensors")
    found = LMLPPipeline.lora_state_dict(tmp_path / "repo", subfolder="loras", weight_name="style.safetensors")
    expected = load_file(tmp_path / "repo" / "loras" / "style.safetensors")
    assert sorted(found) == sorted(expected) and all(torch.equal(found[k], expected[k]) for k in expected)

    with pytest.raises(ValueError, match=r"has no pytorch_lora_weights\.safetensors \(it holds \['loras'\]\)"):
        LMLPPipeline.lora_state_dict(tmp_path / "repo")
    with pytest.raises(ValueError, match="is a file: pass its folder"):
        LMLPPipeline.lora_state_dict(tmp_path / "repo" / "loras" / "style.safetensors", weight_name="o.safetensors")
    with pytest.raises(ValueError, match="do not apply to a state dict"):
        LMLPPipeline.lora_state_dict(expected, weight_name="style.safetensors")
    with pytest.raises(TypeError, match="unexpected keyword argument 'adapter_nam'"):
        make_pipe().load_lora_weights(tmp_path / "repo" / "loras" / "style.safetensors", adapter_nam="typo")


def test_paths_that_lead_out_of_the_folder_are_refused_without_naming_other_files(make_pipe, tmp_path):
    write_lora(make_pipe, tmp_path / "repo" / "loras")
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "notes.txt").write_text("not for error messages")
    repo = tmp_path / "repo"
    with pytest.raises(ValueError) as missing:
        LMLPPipeline.lora_state_dict(repo, subfolder="lora")
    assert str(missing.value) == f"{repo} has no subfolder 'lora' ({repo / 'lora'} does not exist)."
    for outside in ("../private", str(tmp_path / "private")):
        with pytest.raises(ValueError, match=f"leads out of {re.escape(str(repo))}") as refused:
            LMLPPipeline.lora_state_dict(repo, subfolder=outside)
        assert "notes.txt" not in str(refused.value)
    for weight_name in ("../repo/loras/pytorch_lora_weights.safetensors", "/abs/x.safetensors"):
        with pytest.raises(ValueError, match="leads out of the folder"):
            LMLPPipeline.lora_state_dict(tmp_path / "private", weight_name=weight_name)
        with pytest.raises(ValueError, match="leads out of the folder"):
            tensors = {"transformer.x.lora_A.weight": torch.ones(1)}
            LMLPPipeline.save_lora_weights(tmp_path / "private", tensors, weight_name=weight_name)


@pytest.mark.parametrize("family", LINEAR_AND_TIED)
def test_fuse_unfuse_disable_low_cpu_mem_usage_and_unload(make_pipe, generate, tmp_path, family):
    write_lora(make_pipe, tmp_path, family)
    pipe = make_pipe(family)
    base, own = generate(pipe), {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(tmp_path, adapter_name="style")
    adapted = generate(pipe)
    layer = pipe.transformer.stack.mid_block.get_submodule("channel_mlp" if family == "symmixer" else "right")
    before = layer.get_base_layer().weight.detach().clone()

    pipe.fuse_lora()
    assert pipe.fused_loras == {"style"}
    assert not torch.equal(layer.get_base_layer().weight, before), "fuse_lora did not merge into the weights"
    close(generate(pipe), adapted)
    pipe.unfuse_lora()
    assert pipe.num_fused_loras == 0
    restored = {k: v for k, v in pipe.transformer.state_dict().items() if "lora_" not in k}
    assert len(restored) == len(own)
    for key, value in restored.items():
        torch.testing.assert_close(value, own[unwrapped(key)], rtol=0, atol=1e-6)
    close(generate(pipe), adapted)  # unfused, the adapter still runs
    pipe.disable_lora()
    close(generate(pipe), base)
    pipe.enable_lora()
    close(generate(pipe), adapted)

    pipe = make_pipe(family)
    pipe.load_lora_weights(tmp_path, low_cpu_mem_usage=True)  # the same adapter
    torch.testing.assert_close(generate(pipe), adapted, rtol=0, atol=0)
    pipe.unload_lora_weights()  # restores the exact base model
    assert (
        not has_lora_layers(pipe) and not pipe.get_list_adapters() and set(pipe.transformer.state_dict()) == set(own)
    )
    torch.testing.assert_close(generate(pipe), base, rtol=0, atol=0)
    pipe.load_lora_weights(tmp_path)
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # fused first: keeps the merged weights, without lora layers
    assert not has_lora_layers(pipe)
    close(generate(pipe), adapted)


@pytest.mark.parametrize("family", LINEAR_AND_TIED)
def test_safe_fusing_refuses_an_adapter_with_nan_and_leaves_the_weights(make_pipe, tmp_path, family):
    write_lora(make_pipe, tmp_path, family)
    pipe = make_pipe(family)
    pipe.load_lora_weights(tmp_path, adapter_name="broken")
    parameters = dict(pipe.transformer.named_parameters())
    broken = next(name for name in parameters if name.startswith("stack.mid_block.") and ".lora_B.broken" in name)
    with torch.no_grad():  # a file with NaN is refused when loaded: the adapter goes bad in memory
        parameters[broken][0, 0] = float("nan")
    own = {k: v.clone() for k, v in pipe.transformer.state_dict().items() if "lora_" not in k}
    with pytest.raises(
        ValueError, match=rf"'broken' holds NaN or inf in its update of {broken.rsplit('.lora_B.')[0]}"
    ):
        pipe.fuse_lora(safe_fusing=True)
    assert pipe.fused_loras == set()
    assert all(torch.equal(pipe.transformer.state_dict()[key], value) for key, value in own.items())


@pytest.mark.parametrize("family", LINEAR_AND_TIED)
def test_scales_weights_and_two_adapters_combine(make_pipe, generate, tmp_path, family):
    write_lora(make_pipe, tmp_path / "a", family, seed=1)
    write_lora(make_pipe, tmp_path / "b", family, seed=2, r=3, lora_alpha=1)
    half = generate(merged_by_hand(make_pipe(family), (tmp_path / "a", 0.5)))
    pipe = make_pipe(family)
    pipe.load_lora_weights(tmp_path / "a", adapter_name="a")
    pipe.set_adapters("a", adapter_weights=0.5)
    close(generate(pipe), half)
    pipe.set_adapters("a", adapter_weights=1.0)
    pipe.fuse_lora(lora_scale=0.5)
    close(generate(pipe), half)
    pipe.unfuse_lora()
    close(generate(pipe), half)  # as in diffusers, the adapter keeps the fused scale...
    pipe.set_adapters("a")
    close(generate(pipe), generate(merged_by_hand(make_pipe(family), (tmp_path / "a", 1.0))))  # ...until set again

    pipe.load_lora_weights(tmp_path / "b", adapter_name="b")
    assert pipe.get_list_adapters() == {"transformer": ["a", "b"]}
    pipe.set_adapters(["a", "b"], adapter_weights=[1.0, -0.5])
    assert pipe.get_active_adapters() == ["a", "b"]
    close(generate(pipe), generate(merged_by_hand(make_pipe(family), (tmp_path / "a", 1.0), (tmp_path / "b", -0.5))))
    pipe.delete_adapters("a")
    assert pipe.get_list_adapters() == {"transformer": ["b"]}
    pipe.set_adapters("b")
    close(generate(pipe), generate(merged_by_hand(make_pipe(family), (tmp_path / "b", 1.0))))


def test_hotswap_replaces_the_weights_of_a_loaded_adapter(make_pipe, generate, tmp_path):
    write_lora(make_pipe, tmp_path / "a", seed=1)
    write_lora(make_pipe, tmp_path / "b", seed=2)
    pipe = make_pipe()
    pipe.load_lora_weights(tmp_path / "a", adapter_name="style")
    pipe.load_lora_weights(tmp_path / "b", adapter_name="style", hotswap=True)
    assert pipe.get_list_adapters() == {"transformer": ["style"]}
    expected = generate(merged_by_hand(make_pipe(), (tmp_path / "b", 1.0)))
    close(generate(pipe), expected)
    with pytest.raises(ValueError, match="hotswap replaces a loaded adapter"):
        pipe.load_lora_weights(tmp_path / "b", adapter_name="other", hotswap=True)
    with pytest.raises(ValueError, match="already in use"):
        pipe.load_lora_weights(tmp_path / "b", adapter_name="style")
    close(generate(pipe), expected)


class Armed:
    """Unpickling this creates the folder `marker`: the proof that a loader unpickled the file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_the_armed_pickle_does_create_its_marker_when_unpickled(tmp_path):
    pickle.loads(pickle.dumps(Armed(tmp_path / "marker")))
    assert (tmp_path / "marker").exists()


@pytest.mark.parametrize(
    "where, kwargs",
    [
        ("pytorch_lora_weights.bin", {}),  # the pickle's own path
        (".", {}),  # a folder with only a pickle
        (".", {"weight_name": "pytorch_lora_weights.bin"}),
        (".", {"use_safetensors": False}),
        ("renamed.safetensors", {}),  # a pickle under a safetensors name
    ],
)
def test_a_pickled_lora_is_refused_without_unpickling(make_pipe, generate, tmp_path, where, kwargs):
    marker = tmp_path.parent / f"{tmp_path.name}-unpickled"
    payload = pickle.dumps({"transformer.stack.mid_block.right.lora_A.weight": Armed(marker)})
    (tmp_path / "pytorch_lora_weights.bin").write_bytes(payload)
    if where == "renamed.safetensors":
        (tmp_path / where).write_bytes(payload)
    pipe = make_pipe()
    assert_refused_and_unchanged(pipe, generate, lambda: pipe.load_lora_weights(tmp_path / where, **kwargs), "safet")
    assert not marker.exists(), "the pickle was unpickled"


def pair(layer: str, shape_a: tuple[int, int], shape_b: tuple[int, int]) -> dict[str, torch.Tensor]:
    return {
        f"transformer.{layer}.lora_A.weight": torch.zeros(shape_a),
        f"transformer.{layer}.lora_B.weight": torch.zeros(shape_b),
    }


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda sd: {**sd, **pair("stack.nope", (2, 32), (32, 2))}, "does not have"),
        (lambda sd: {**sd, "transformer.stack.mid_block.right.weight": torch.zeros(32, 32)}, "not LoRA matrices"),
        (lambda sd: {**sd, "text_encoder.fc.lora_A.weight": torch.zeros(2, 32)}, "without the `transformer.` prefix"),
        (lambda sd: {k: v for k, v in sd.items() if "mid_block.right.lora_B" not in k}, "lora_B missing"),
        (lambda sd: {**sd, **pair("stack.mid_block.right", (2, 31), (32, 2))}, "another config"),
        (lambda sd: {**sd, **pair("stack.mid_block.right", (2, 32), (32, 3))}, "one rank r"),
        (lambda sd: {**sd, **pair("stack.mid_block.token_norm", (2, 33), (33, 2))}, "not an nn.Linear"),
    ],
    ids=["unknown layer", "full weight", "text encoder", "half a pair", "shape", "rank", "layer norm"],
)
def test_keys_that_do_not_fit_the_transformer_are_refused(make_pipe, generate, tmp_path, change, message):
    write_lora(make_pipe, tmp_path, target_modules=["right"])
    state_dict = change(load_file(tmp_path / WEIGHT_NAME))
    pipe = make_pipe()
    assert_refused_and_unchanged(pipe, generate, lambda: pipe.load_lora_weights(state_dict), message)


def test_a_lora_trained_for_another_model_config_is_refused(make_pipe, tmp_path):
    write_lora(make_pipe, tmp_path)
    config = dict(sample_size=8, patch_size=2, in_channels=4, hidden_size=48, num_layers=2, text_embed_dim=32)
    transformer = FAMILIES["lmlp"].model_class(**config, text_seq_len=16)
    pipe = LMLPPipeline(**{**make_pipe().components, "transformer": transformer})
    with pytest.raises(ValueError, match=r"maps \d+ to \d+ features.*another config"):
        pipe.load_lora_weights(tmp_path)


@pytest.mark.parametrize(
    "family, keep, config, message",
    [
        ("lmlp", "", {"r": 4}, "rank that its config gives"),
        ("symmixer", "", {"r": 4}, "rank that its config gives"),
        ("symmixer", "mlp", {"target_parameters": ["token_mlp.weight"]},
         r"adapts stack\.in_blocks\.0\.channel_mlp, a SymmetricMLP, not an nn\.Linear"),
        ("symmixer", "token_mlp", {"target_parameters": ["token_mlp.weight", "channel_mlp.weight"]},
         r"adapted without weights stack\.in_blocks\.0\.channel"),
    ],
    ids=["rank", "tied rank", "config misses file layers", "file misses config layers"],
)  # fmt: skip
def test_a_config_that_contradicts_the_weights_is_refused_and_rolled_back(
    make_pipe, generate, tmp_path, family, keep, config, message
):
    # The adapter saved again with only its keys holding `keep` and `config` overriding its LoraConfig.
    adapted = write_lora(make_pipe, tmp_path, family).transformer
    layers = {k: v for k, v in get_peft_model_state_dict(adapted).items() if keep in k}
    metadata = {**adapted.peft_config["default"].to_dict(), **config}
    LMLPPipeline.save_lora_weights(
        tmp_path, transformer_lora_layers=layers, transformer_lora_adapter_metadata=metadata
    )
    pipe = make_pipe(family)
    assert_refused_and_unchanged(pipe, generate, lambda: pipe.load_lora_weights(tmp_path), message)


def test_a_tied_weight_lora_without_its_config_or_hotswapped_is_refused(make_pipe, tmp_path):
    write_lora(make_pipe, tmp_path, "symmixer")
    with pytest.raises(ValueError, match="target_parameters"):
        make_pipe("symmixer").load_lora_weights(load_file(tmp_path / WEIGHT_NAME))  # a state dict has no metadata
    pipe = make_pipe("symmixer")
    pipe.load_lora_weights(tmp_path, adapter_name="style")
    with pytest.raises(ValueError, match="hotswap is not supported"):
        pipe.load_lora_weights(tmp_path, adapter_name="style", hotswap=True)


def test_a_second_asymmixer_adapter_that_peft_cannot_place_is_refused_and_the_first_kept(
    make_pipe, generate, tmp_path
):
    write_lora(make_pipe, tmp_path, "asymmixer")
    pipe = make_pipe("asymmixer")
    pipe.load_lora_weights(tmp_path, adapter_name="first")
    adapted = generate(pipe)
    with pytest.raises(ValueError, match=r"not adapted .*fc2.*peft 0\.21"):
        pipe.load_lora_weights(tmp_path, adapter_name="second")
    assert pipe.get_list_adapters() == {"transformer": ["first"]}
    torch.testing.assert_close(generate(pipe), adapted, rtol=0, atol=0)


def test_save_lora_weights_writes_safetensors_with_its_config_or_refuses(make_pipe, tmp_path):
    adapted = write_lora(make_pipe, tmp_path / "written")
    layers, config = get_peft_model_state_dict(adapted.transformer), adapted.transformer.peft_config["default"]
    for kwargs, message in [
        ({"safe_serialization": False}, "never pickled"),
        ({"weight_name": "pytorch_lora_weights.bin"}, "not a safetensors file"),
        ({"transformer_lora_layers": adapted.transformer}, "not LoRA matrices"),  # the whole model's weights
        ({"transformer_lora_layers": {}}, "Pass the LoRA weights"),
    ]:
        with pytest.raises(ValueError, match=message):
            LMLPPipeline.save_lora_weights(tmp_path / "refused", **{"transformer_lora_layers": layers, **kwargs})
    assert not (tmp_path / "refused").exists()
    LMLPPipeline.save_lora_weights(tmp_path / "worker", transformer_lora_layers=layers, is_main_process=False)
    assert not (tmp_path / "worker").exists()

    calls = []
    LMLPPipeline.save_lora_weights(
        tmp_path / "custom",
        transformer_lora_layers=layers,
        save_function=lambda tensors, filename, metadata: calls.append((sorted(tensors), filename, metadata)),
        transformer_lora_adapter_metadata=config.to_dict(),
    )
    ((keys, filename, metadata),) = calls
    assert keys == sorted(load_file(tmp_path / "written" / WEIGHT_NAME)) and filename.endswith(WEIGHT_NAME)
    assert metadata["format"] == "pt" and '"transformer.r": 2' in metadata["lora_adapter_metadata"]


def test_a_lora_without_transformer_weights_is_refused_naming_the_file(make_pipe, generate, tmp_path):
    text_encoder = pair("text_encoder.fc", (2, 32), (32, 2))
    text_encoder = {key.removeprefix("transformer."): value for key, value in text_encoder.items()}
    holds_other = (
        "holds no LoRA weights for the transformer: none of its 2 keys has the `transformer.` prefix "
        "(text_encoder.fc.lora_A.weight, text_encoder.fc.lora_B.weight)"
    )
    holds_none = "holds no tensors, so it would load as an adapter that changes nothing"
    for tensors, holds in [({}, holds_none), (text_encoder, holds_other)]:
        save_file(tensors, tmp_path / WEIGHT_NAME, metadata={"format": "pt"})
        pipe = make_pipe()
        for source, where in [(tmp_path, tmp_path / WEIGHT_NAME), (tensors, "The state dict")]:
            message = re.escape(f"{where} {holds}")
            assert_refused_and_unchanged(pipe, generate, lambda: pipe.load_lora_weights(source), message)


@pytest.mark.parametrize(
    "raw, found",
    [
        ('{"transformer.r": 2', "malformed JSON (Expecting ',' delimiter: line 1 column 20 (char 19))"),
        ('["transformer.r", 2]', 'a JSON array, ["transformer.r", 2]'),
        ("2", "a JSON number, 2"),
        ('"r=2"', 'a JSON string, "r=2"'),
        ("null", "a JSON null, null"),
    ],
    ids=["malformed", "array", "number", "string", "null"],
)
def test_lora_metadata_that_is_not_a_json_object_is_refused_naming_the_file_and_the_key(
    make_pipe, tmp_path, raw, found
):
    write_lora(make_pipe, tmp_path)
    path = tmp_path / WEIGHT_NAME
    save_file(load_file(path), path, metadata={"format": "pt", "lora_adapter_metadata": raw})
    expected = (
        f"{path}: the header entry 'lora_adapter_metadata' must be the adapter's LoraConfig as a JSON object "
        f"(lora_config.to_dict(), as save_lora_weights writes it), but it is {found}."
    )
    pipe = make_pipe()
    with pytest.raises(ValueError, match=re.escape(expected)) as refused:
        pipe.load_lora_weights(tmp_path)
    assert refused.value.__context__ is None  # one error, not a JSON traceback inside it
    assert pipe.get_list_adapters() == {}


def unknown_half(tensors: dict, config: dict) -> tuple[dict, dict]:
    layers = sorted({key.rsplit(".lora_", 1)[0] for key in tensors})
    renamed = {layer: f"transformer.nowhere_{k}" for k, layer in enumerate(layers[: len(layers) // 2])}
    split = (key.rsplit(".lora_", 1) for key in tensors)
    return {
        f"{renamed.get(layer, layer)}.lora_{rest}": tensors[f"{layer}.lora_{rest}"] for layer, rest in split
    }, config


def nan_lora_b(tensors: dict, config: dict) -> tuple[dict, dict]:
    tensors[next(key for key in sorted(tensors) if key.endswith("lora_B.weight"))][0, 0] = float("nan")
    return tensors, config


@pytest.mark.parametrize("loader", ["pipe.load_lora_weights", "pipe.transformer.load_lora_adapter"])
@pytest.mark.parametrize(
    "edit, message",
    [
        (unknown_half, r"LoRA keys for layers the LMLPTransformer2DModel does not have: nowhere_0"),
        (lambda tensors, config: ({}, config), r"holds no tensors, so it would load as an adapter that changes"),
        (nan_lora_b, r"holds NaN or inf in stack\..*lora_B\.weight: the LoRA is broken"),
        (lambda t, c: (t, {**c, "transformer.lora_alpha": float("nan")}), r"lora_alpha=nan, which must be a posit"),
        (lambda t, c: (t, {**c, "transformer.r": "4"}), r"r='4', which must be a positive integer"),
        (lambda t, c: (t, {**c, "transformer.lora_alpha": "x"}), r"lora_alpha='x', which must be a positive finite"),
        (lambda t, c: (t, {**c, "transformer.target_modules": 5}), r"target_modules=5, which must be a string or"),
    ],
    ids=["half-unknown", "empty", "nan-lora_B", "nan-alpha", "string-r", "string-alpha", "number-targets"],
)
def test_a_lora_that_would_load_silently_or_fail_inside_peft_is_refused_by_either_loader(
    make_pipe, generate, tmp_path, loader, edit, message
):
    # diffusers' own load_lora_adapter loaded the first four silently, and raised TypeError from peft on the rest.
    write_lora(make_pipe, tmp_path)
    path = tmp_path / WEIGHT_NAME
    with safetensors.safe_open(path, "pt") as file:
        tensors = {key: file.get_tensor(key) for key in file.keys()}
        config = json.loads(file.metadata()["lora_adapter_metadata"])
    tensors, config = edit(tensors, config)
    save_file(tensors, path, metadata={"format": "pt", "lora_adapter_metadata": json.dumps(config)})
    pipe = make_pipe()
    load = pipe.load_lora_weights if loader == "pipe.load_lora_weights" else pipe.transformer.load_lora_adapter
    assert_refused_and_unchanged(pipe, generate, lambda: load(tmp_path), message)
