"""The registry of block families (`--model_type`, tiny pipelines, complexity, cards, the Space); it imports no model.
A new family is a file in `models/mixers/` (its block and `UShapedMixerModel` subclass) and an entry in `FAMILIES`."""

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .catalog import NAMED_CONFIGS


if TYPE_CHECKING:
    from .backbone import UShapedMixerModel


@dataclass(frozen=True)
class BlockFamily:
    """One family of backbones: its key (`--model_type`), public class and its module under `models`, label (cards,
    tables), paper (Markdown), Hub tag, the config a tiny model needs, its config's own part in words (`details`),
    and LoRA's default targets: `nn.Linear` name regexes in a block, and 2-D weights used without an `nn.Linear`
    (the tied SymMixer/AsymMixer weights, PEFT's `target_parameters`)."""

    name: str
    class_name: str
    module: str
    label: str
    paper: str
    tag: str
    tiny_overrides: dict[str, Any] = field(default_factory=dict)
    details: Callable[[Mapping], str] = lambda config: ""
    lora_target_modules: tuple[str, ...] = ()
    lora_target_parameters: tuple[str, ...] = ()

    @functools.cached_property
    def model_class(self) -> type["UShapedMixerModel"]:
        """The public diffusers model (imported on first use)."""
        return getattr(importlib.import_module(f"{__package__}.{self.module}"), self.class_name)

    @property
    def named_configs(self) -> dict[str, dict[str, Any]]:
        """The family's named configurations: name -> `__init__` overrides."""
        return NAMED_CONFIGS[self.name]

    @property
    def lora_target_regex(self) -> str | None:
        """PEFT's `target_modules` for the default targets, one regex on full module names (None without targets)."""
        return rf".*\.(?:{'|'.join(self.lora_target_modules)})" if self.lora_target_modules else None

    def full_config(self, config: Mapping) -> dict[str, Any]:
        """A (possibly partial) config of `model_class`, completed with the `__init__` defaults."""
        parameters = inspect.signature(self.model_class.__init__).parameters.values()
        defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
        return {**defaults, **{k: v for k, v in config.items() if not k.startswith("_")}}


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


_PARAMIXER_PAPER = (
    "[Hierarchical Associative Memory, Parallelized MLP-Mixer, and Symmetry Breaking]"
    "(https://arxiv.org/abs/2406.12220) (Karakida, Ota, Taki 2024)"
)
_MIXER_TARGETS = (r"token_mlp\.fc[12]", r"channel_mlp\.fc[12]")
_TIED_WEIGHTS = ("token_mlp.weight", "channel_mlp.weight")
_LMLP_TARGETS = ("right", "merge", r"joint_mlp\.fc1", r"joint_mlp\.fc2")

FAMILIES: dict[str, BlockFamily] = {family.name: family for family in (
    BlockFamily("lmlp", "LMLPTransformer2DModel", "lmlp_transformer_2d", "UL-MLP",
                "[Lateralization MLP](https://arxiv.org/abs/2405.16098) (Hu & Rostami 2024)", "l-mlp",
                lora_target_modules=("left", *_LMLP_TARGETS)),
    BlockFamily("moe_mlp", "MoEMLPModel", "mixers.moe", "MoE-MLP",
                '"Many Can Beat One: MoE-Linear Attention for Full MLP Image Generation"', "moe-mlp",
                tiny_overrides={"num_experts": 2, "num_heads": 2},
                details=lambda c: f", {_count(c['num_experts'], 'expert')} × {_count(c['num_heads'], 'head')}",
                lora_target_modules=(r"left\.gates\.\d+", *_LMLP_TARGETS)),
    BlockFamily("uvit", "UViTTransformer2DModel", "mixers.attention", "U-ViT",
                "[U-ViT](https://arxiv.org/abs/2209.12152) (Bao et al. 2023)", "u-vit",
                details=lambda c: f", {_count(c['num_attention_heads'], 'attention head')}",
                lora_target_modules=(r"attn\.qkv", r"attn\.proj", r"mlp\.fc1", r"mlp\.fc2", "skip_linear")),
    BlockFamily("mlp_mixer", "MLPMixerTransformer2DModel", "mixers.mlp_mixer", "MLP-Mixer",
                "[MLP-Mixer](https://arxiv.org/abs/2105.01601) (Tolstikhin et al. 2021)", "mlp-mixer",
                lora_target_modules=_MIXER_TARGETS),
    BlockFamily("paramixer", "ParaMixerTransformer2DModel", "mixers.paramixer", "ParaMixer", _PARAMIXER_PAPER,
                "paramixer", lora_target_modules=_MIXER_TARGETS),
    BlockFamily("symmixer", "SymMixerTransformer2DModel", "mixers.paramixer", "SymMixer", _PARAMIXER_PAPER,
                "symmixer", lora_target_parameters=_TIED_WEIGHTS),
    BlockFamily("asymmixer", "AsymMixerTransformer2DModel", "mixers.paramixer", "AsymMixer", _PARAMIXER_PAPER,
                "asymmixer", lora_target_modules=(r"token_mlp\.fc2", r"channel_mlp\.fc2"),
                lora_target_parameters=_TIED_WEIGHTS),
    BlockFamily("gmlp", "GMLPTransformer2DModel", "mixers.gmlp", "gMLP",
                "[gMLP](https://arxiv.org/abs/2105.08050) (Liu et al. 2021)", "gmlp",
                lora_target_modules=("channel_proj1", "channel_proj2", r"sgu\.spatial_proj")),
)}  # fmt: skip


def family_of(model: Any) -> BlockFamily:
    """The family of a backbone instance or class, a class name, or a saved config (which records `_class_name`)."""
    if isinstance(model, Mapping):
        name = model.get("_class_name")
    elif isinstance(model, str):
        name = model
    else:
        name = (model if isinstance(model, type) else type(model)).__name__
    for family in FAMILIES.values():
        if family.class_name == name:
            return family
    known = ", ".join(family.class_name for family in FAMILIES.values())
    raise ValueError(f"{name!r} is not a backbone of a registered block family ({known}).")


def named_configs() -> dict[str, tuple[BlockFamily, dict[str, Any]]]:
    """Every named configuration of every family: name -> (family, `__init__` overrides); names are unique."""
    named: dict[str, tuple[BlockFamily, dict[str, Any]]] = {}
    for family in FAMILIES.values():
        for name, overrides in family.named_configs.items():
            if name in named:
                raise RuntimeError(f"Named configuration {name!r} is in both {named[name][0].name} and {family.name}.")
            named[name] = (family, overrides)
    return named


def from_named_config(name: str, **overrides: Any) -> "UShapedMixerModel":
    """A randomly initialised backbone of any family's named configuration (e.g. "A2", "F2", "2E1H"), `overrides`
    replacing config values (e.g. `sample_size=64`)."""
    named = named_configs()
    if name not in named:
        raise ValueError(f"Unknown named configuration {name!r}; choose one of {sorted(named)}.")
    return named[name][0].model_class.from_named_config(name, **overrides)
