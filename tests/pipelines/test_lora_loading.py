"""LoRA files the diffusers way, checked against W + weight·(alpha/r)·B·A by hand; never a pickle or a skipped key."""

import copy
import json
import os
import pickle
import re
from pathlib import Path
from typing import NamedTuple

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
LINEAR_AND_TIED = ["lmlp", "symmixer"]  # adapters on nn.Linear layers (diffusers' path), on tied weights (peft's)


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
    """Save a random adapter on every block layer (r=2, alpha=4: a loader ignoring alpha is off by 2×)."""
    pipe = make_pipe(family)
    modules, parameters = block_targets(pipe.transformer)
    config = dict(r=2, lora_alpha=4, target_modules=modules, target_parameters=parameters, init_lora_weights=False)
    config = LoraConfig(**{**config, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe.transformer.add_adapter(config)
    layers, meta = get_peft_model_state_dict(pipe.transformer), config.to_dict()
    LMLPPipeline.save_lora_weights(folder, transformer_lora_layers=layers, transformer_lora_adapter_metadata=meta)
    return pipe


def unwrapped(layer: str) -> str:  # peft's wrappers insert `base_layer`
    return ".".join(part for part in layer.split(".") if part != "base_layer")


def file_layers(folder: Path) -> set[str]:
    return {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in load_file(folder / WEIGHT_NAME)}


def merged_by_hand(pipe: LMLPPipeline, *adapters: tuple[Path, float]) -> LMLPPipeline:
    """`pipe` with W + weight·(alpha/r)·B·A of each LoRA file added to a copy of its weights, by safetensors."""
    transformer = copy.deepcopy(pipe.transformer)
    with torch.no_grad():
        for folder, weight in adapters:
            tensors = load_file(folder / WEIGHT_NAME)
            with safetensors.safe_open(folder / WEIGHT_NAME, "pt") as file:
                config = json.loads(file.metadata()["lora_adapter_metadata"])
            for layer in file_layers(folder):
                down, up = (tensors[f"transformer.{layer}.lora_{x}.weight"] for x in "AB")  # (r, in), (out, r)
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


def assert_refused_and_unchanged(pipe: LMLPPipeline, generate, load, message: str) -> ValueError:
    base = generate(pipe)
    with pytest.raises(ValueError, match=message) as refused:
        load()
    assert pipe.get_list_adapters() == {} and not has_lora_layers(pipe)
    torch.testing.assert_close(generate(pipe), base, rtol=0, atol=0)
    return refused.value


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_saved_lora_loads_to_the_hand_merged_weights_on_every_layer(make_pipe, generate, tmp_path, family):
    in_memory = write_lora(make_pipe, tmp_path, family)
    pipe = make_pipe(family)
    base = generate(pipe)
    # The file has every adaptable layer of every block, and the loaded adapter adapts exactly the file's layers.
    modules, parameters = block_targets(pipe.transformer)
    names = {name for name, _ in pipe.transformer.named_modules()}
    targets = [*modules, *(parameter.rsplit(".", 1)[0] for parameter in parameters)]
    every_layer = {f"{b}.{t}" for b in blocks(pipe.transformer) for t in targets if f"{b}.{t}" in names}
    pipe.load_lora_weights(tmp_path, adapter_name="style")
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


def test_save_lora_weights_writes_what_diffusers_writes_and_reads_or_refuses(make_pipe, generate, tmp_path):
    patterns = dict(rank_pattern={"joint_mlp.fc1": 3}, alpha_pattern={"merge": 8, "joint_mlp.fc1": 1})
    adapted = write_lora(make_pipe, tmp_path / "ours", **patterns)
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
    # diffusers' own model loader, given our file, adapts the transformer the same way.
    by_diffusers, by_us = make_pipe(), make_pipe()
    by_diffusers.transformer.load_lora_adapter(tmp_path / "ours", weight_name=WEIGHT_NAME, use_safetensors=True)
    by_us.load_lora_weights(tmp_path / "ours", adapter_name="style")
    torch.testing.assert_close(generate(by_us), generate(by_diffusers), rtol=0, atol=0)
    loaded, mid_block = by_us.transformer.peft_config["style"], by_us.transformer.stack.mid_block
    fields = ("r", "lora_alpha", "rank_pattern", "alpha_pattern", "target_modules", "use_rslora", "use_dora")
    assert [getattr(loaded, field) for field in fields] == [getattr(config, field) for field in fields]
    assert mid_block.joint_mlp.fc1.lora_A["style"].weight.shape == (3, 32)
    assert mid_block.merge.scaling["style"] == 8 / 2
    close(generate(by_us), generate(merged_by_hand(make_pipe(), (tmp_path / "ours", 1.0))))
    # It refuses what it must not write, writes nothing on a worker and hands a save_function what ours wrote.
    for kwargs, message in [
        ({"safe_serialization": False}, "never pickled"),
        ({"weight_name": "pytorch_lora_weights.bin"}, "not a safetensors file"),
        ({"transformer_lora_layers": adapted.transformer}, "not LoRA matrices"),  # the whole model's weights
        ({"transformer_lora_layers": {}}, "Pass the LoRA weights"),
        ({"weight_name": "../x.safetensors"}, "leads out of the folder"),
        ({"weight_name": "/abs/x.safetensors"}, "leads out of the folder"),
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
    ((keys, filename, header),) = calls
    assert (keys, header) == (sorted(written["ours"][1]), written["ours"][0]) and filename.endswith(WEIGHT_NAME)


def test_a_file_state_dict_hub_repo_or_weight_name_load_as_the_folder(make_pipe, generate, tmp_path, monkeypatch):
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
    with pytest.raises(ValueError, match="^The state dict holds no tensors, so it would load as an adapter"):
        without_metadata.load_lora_weights({})
    close(generate(without_metadata), generate(merged_by_hand(make_pipe(), (tmp_path / "lora", 0.5))))
    # weight_name and subfolder choose the file, and never lead out of the folder.
    repo, private = tmp_path / "repo", tmp_path / "private"
    (repo / "loras").mkdir(parents=True)
    (tmp_path / "lora" / WEIGHT_NAME).rename(repo / "loras" / "style.safetensors")
    found = LMLPPipeline.lora_state_dict(repo, subfolder="loras", weight_name="style.safetensors")
    expected = load_file(repo / "loras" / "style.safetensors")
    assert sorted(found) == sorted(expected) and all(torch.equal(found[k], expected[k]) for k in expected)
    private.mkdir()
    (private / "notes.txt").write_text("not for error messages")
    out_of_repo = f"leads out of {re.escape(str(repo))}"
    missing = re.escape(f"{repo} has no subfolder 'lora' ({repo / 'lora'} does not exist).")
    for source, kwargs, message in [
        (repo, {}, r"has no pytorch_lora_weights\.safetensors \(it holds \['loras'\]\)"),
        (repo / "loras" / "style.safetensors", {"weight_name": "o.safetensors"}, "is a file: pass its folder"),
        (expected, {"weight_name": "style.safetensors"}, "do not apply to a state dict"),
        (repo, {"subfolder": "lora"}, f"^{missing}$"),
        (repo, {"subfolder": "../private"}, out_of_repo),
        (repo, {"subfolder": str(private)}, out_of_repo),
        (private, {"weight_name": "../repo/loras/style.safetensors"}, "leads out of the folder"),
        (private, {"weight_name": "/abs/x.safetensors"}, "leads out of the folder"),
    ]:
        with pytest.raises(ValueError, match=message) as refused:
            LMLPPipeline.lora_state_dict(source, **kwargs)
        assert "notes.txt" not in str(refused.value)
    with pytest.raises(TypeError, match="unexpected keyword argument 'adapter_nam'"):
        make_pipe().load_lora_weights(repo / "loras" / "style.safetensors", adapter_nam="typo")


@pytest.mark.parametrize("family", LINEAR_AND_TIED)
def test_fuse_unfuse_disable_low_cpu_mem_usage_unload_and_safe_fusing(make_pipe, generate, tmp_path, family):
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
    restored = {unwrapped(k): v for k, v in pipe.transformer.state_dict().items() if "lora_" not in k}
    assert restored.keys() == own.keys()
    assert all(torch.allclose(v, own[k], rtol=0, atol=1e-6) for k, v in restored.items())
    close(generate(pipe), adapted)  # unfused, the adapter still runs
    pipe.disable_lora()
    close(generate(pipe), base)
    pipe.enable_lora()
    close(generate(pipe), adapted)
    pipe = make_pipe(family)
    pipe.load_lora_weights(tmp_path, low_cpu_mem_usage=True)  # the same adapter
    torch.testing.assert_close(generate(pipe), adapted, rtol=0, atol=0)
    pipe.unload_lora_weights()  # restores the exact base model
    assert not has_lora_layers(pipe) and not pipe.get_list_adapters()
    assert pipe.transformer.state_dict().keys() == own.keys()
    torch.testing.assert_close(generate(pipe), base, rtol=0, atol=0)
    pipe.load_lora_weights(tmp_path)
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # fused first: keeps the merged weights, without lora layers
    assert not has_lora_layers(pipe)
    close(generate(pipe), adapted)
    # safe_fusing refuses an adapter gone bad in memory (a file with NaN is refused when loaded), weights untouched.
    pipe.load_lora_weights(tmp_path, adapter_name="broken")
    own = {k: v.clone() for k, v in pipe.transformer.state_dict().items() if "lora_" not in k}
    broken = next(n for n in pipe.transformer.state_dict() if n.startswith("stack.mid_block.") and ".lora_B" in n)
    with torch.no_grad():
        pipe.transformer.get_parameter(broken)[0, 0] = float("nan")
    with pytest.raises(ValueError, match=rf"'broken' holds NaN or inf in its update of {broken.split('.lora_B.')[0]}"):
        pipe.fuse_lora(safe_fusing=True)
    assert "broken" not in pipe.fused_loras
    assert all(torch.equal(pipe.transformer.state_dict()[k], v) for k, v in own.items())


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


def test_hotswap_and_second_adapters_where_peft_allows_them(make_pipe, generate, tmp_path):
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
    write_lora(make_pipe, tmp_path / "tied", "symmixer")
    with pytest.raises(ValueError, match="target_parameters"):  # a state dict has no config
        make_pipe("symmixer").load_lora_weights(load_file(tmp_path / "tied" / WEIGHT_NAME))
    pipe = make_pipe("symmixer")
    pipe.load_lora_weights(tmp_path / "tied", adapter_name="style")
    with pytest.raises(ValueError, match="hotswap is not supported"):
        pipe.load_lora_weights(tmp_path / "tied", adapter_name="style", hotswap=True)
    # A second asymmixer adapter that peft cannot place is refused, and the first kept.
    write_lora(make_pipe, tmp_path / "asym", "asymmixer")
    pipe = make_pipe("asymmixer")
    pipe.load_lora_weights(tmp_path / "asym", adapter_name="first")
    adapted = generate(pipe)
    with pytest.raises(ValueError, match=r"not adapted .*fc2.*peft 0\.21"):
        pipe.load_lora_weights(tmp_path / "asym", adapter_name="second")
    assert pipe.get_list_adapters() == {"transformer": ["first"]}
    torch.testing.assert_close(generate(pipe), adapted, rtol=0, atol=0)


class Armed(NamedTuple):  # unpickled, it creates the folder `marker`: the proof that a loader unpickled the file
    marker: str

    def __reduce__(self):
        return os.mkdir, (self.marker,)


# The pickle's own path, a folder with only a pickle (found by default, by name, or asked for), a safetensors name.
@pytest.mark.parametrize("where, kwargs", [
    ("pytorch_lora_weights.bin", {}), (".", {}), (".", {"weight_name": "pytorch_lora_weights.bin"}),
    (".", {"use_safetensors": False}), ("renamed.safetensors", {}),
])  # fmt: skip
def test_a_pickled_lora_is_refused_without_unpickling(make_pipe, generate, tmp_path, where, kwargs):
    marker = tmp_path.parent / f"{tmp_path.name}-unpickled"
    payload = pickle.dumps({"transformer.stack.mid_block.right.lora_A.weight": Armed(str(marker))})
    (tmp_path / "pytorch_lora_weights.bin").write_bytes(payload)
    if where == "renamed.safetensors":
        (tmp_path / where).write_bytes(payload)
    pipe = make_pipe()
    assert_refused_and_unchanged(pipe, generate, lambda: pipe.load_lora_weights(tmp_path / where, **kwargs), "safet")
    assert not marker.exists(), "the pickle was unpickled"
    pickle.loads(payload)  # the proof it would have been: unpickled, it creates the marker
    assert marker.exists()


def pair(layer: str, shape_a: tuple[int, int], shape_b: tuple[int, int]) -> dict[str, torch.Tensor]:
    return {f"transformer.{layer}.lora_{x}.weight": torch.zeros(shape) for x, shape in zip("AB", (shape_a, shape_b))}


# How the file's tensors are changed, and the refusal.
# fmt: off
KEY_CHANGES = {
    "full weight": (lambda sd: {**sd, "transformer.stack.mid_block.right.weight": torch.zeros(32, 32)}, "not LoRA"),
    "text encoder": (lambda sd: {**sd, "text_encoder.fc.lora_A.weight": torch.zeros(2, 32)},
                     "^{path} has LoRA keys without the `transformer.` prefix: text_encoder"),
    "half a pair": (lambda sd: {k: v for k, v in sd.items() if "right.lora_B" not in k}, "lora_B missing"),
    "shape": (lambda sd: {**sd, **pair("stack.mid_block.right", (2, 31), (32, 2))}, r"maps 32 to 32 .*another config"),
    "rank": (lambda sd: {**sd, **pair("stack.mid_block.right", (2, 32), (32, 3))}, "one rank r"),
    "layer norm": (lambda sd: {**sd, **pair("stack.mid_block.token_norm", (2, 33), (33, 2))}, "not an nn.Linear"),
}
# fmt: on


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
def test_a_config_contradicting_the_weights_is_refused(make_pipe, generate, tmp_path, family, keep, config, message):
    # The adapter saved again with only its keys holding `keep` and `config` overriding its LoraConfig.
    adapted = write_lora(make_pipe, tmp_path, family).transformer
    layers = {k: v for k, v in get_peft_model_state_dict(adapted).items() if keep in k}
    meta = {**adapted.peft_config["default"].to_dict(), **config}
    LMLPPipeline.save_lora_weights(tmp_path, transformer_lora_layers=layers, transformer_lora_adapter_metadata=meta)
    pipe = make_pipe(family)
    assert_refused_and_unchanged(pipe, generate, lambda: pipe.load_lora_weights(tmp_path), message)


def nan_lora_b(tensors: dict, config: dict) -> tuple[dict, dict]:
    tensors[next(key for key in sorted(tensors) if key.endswith("lora_B.weight"))][0, 0] = float("nan")
    return tensors, config


NOT_AN_OBJECT = (
    r"^{path}: the header entry 'lora_adapter_metadata' must be .*JSON object \(lora_config\.to_dict\(\).* it is "
)


def header(value: dict | str):
    """An edit of the file: its header's adapter config updated with a dict, or replaced with raw text."""
    return lambda tensors, config: (tensors, {**config, **value} if isinstance(value, dict) else value)


# (how the saved file is edited, the refusal)
# fmt: off
BROKEN_FILES = {
    "an unknown layer": (lambda t, c: ({**t, **pair("stack.nope", (2, 32), (32, 2))}, c),
                         r"LoRA keys for layers the LMLPTransformer2DModel does not have: stack\.nope"),
    "empty": (lambda t, c: ({}, c), r"^{path} holds no tensors, so it would load as an adapter that changes"),
    "nan-lora_B": (nan_lora_b, r"holds NaN or inf in stack\..*lora_B\.weight: the LoRA is broken"),
    "nan-alpha": (header({"transformer.lora_alpha": float("nan")}), r"lora_alpha=nan, which must be a posit"),
    "string-r": (header({"transformer.r": "4"}), r"r='4', which must be a positive integer"),
    "string-alpha": (header({"transformer.lora_alpha": "x"}), r"lora_alpha='x', which must be a positive"),
    "number-targets": (header({"transformer.target_modules": 5}), r"target_modules=5, which must be a str"),
    "no transformer keys": (lambda t, c: ({k.replace("transformer.", "vae.", 1): v for k, v in t.items()}, c),
                            r"^{path} holds no LoRA weights for the transformer: none of its \d+ keys has the"),
    "malformed JSON": (header('{"transformer.r": 2'),
                       NOT_AN_OBJECT + r"malformed JSON \(Expecting ',' delimiter: line 1 column 20 \(char 19\)\)"),
    "JSON array": (header('["transformer.r", 2]'), NOT_AN_OBJECT + r'a JSON array, \["transformer.r", 2\]\.'),
    "JSON number": (header("2"), NOT_AN_OBJECT + r"a JSON number, 2\."),
    "JSON string": (header('"r=2"'), NOT_AN_OBJECT + r'a JSON string, "r=2"\.'),
    "JSON null": (header("null"), NOT_AN_OBJECT + r"a JSON null, null\."),
}
# fmt: on
BROKEN_FILES |= {
    case: (lambda t, c, change=change: (change(t), c), message) for case, (change, message) in KEY_CHANGES.items()
}


@pytest.mark.parametrize("loader", ["pipe.load_lora_weights", "pipe.transformer.load_lora_adapter"])
@pytest.mark.parametrize("case", BROKEN_FILES)
def test_a_broken_lora_file_is_refused_by_either_loader(make_pipe, generate, tmp_path, loader, case):
    # diffusers' own load_lora_adapter loaded the first four silently, and raised from peft or json on others.
    write_lora(make_pipe, tmp_path)
    path = tmp_path / WEIGHT_NAME
    with safetensors.safe_open(path, "pt") as file:
        tensors = {key: file.get_tensor(key) for key in file.keys()}
        config = json.loads(file.metadata()["lora_adapter_metadata"])
    edit, message = BROKEN_FILES[case]
    tensors, config = edit(tensors, config)
    raw = config if isinstance(config, str) else json.dumps(config)
    save_file(tensors, path, metadata={"format": "pt", "lora_adapter_metadata": raw})
    pipe = make_pipe()
    load = pipe.load_lora_weights if loader == "pipe.load_lora_weights" else pipe.transformer.load_lora_adapter
    message = message.replace("{path}", re.escape(str(path)))  # one error, not a JSON or peft traceback inside it:
    assert assert_refused_and_unchanged(pipe, generate, lambda: load(tmp_path), message).__context__ is None
