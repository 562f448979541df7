"""The registry of block families: each family's name, class, label and named configs, read by `--model_type`,
`build_tiny_pipeline`, complexity, cards and the Space. It imports no model (`model_class` imports on first read).
A new family is a file in `models/mixers/` with its block and `UShapedMixerModel` subclass, and an entry below.
"""

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .catalog import NAMED_CONFIGS


if TYPE_CHECKING:
    from .backbone import UShapedMixerModel


def _no_details(config: Mapping) -> str:
    return ""


@dataclass(frozen=True)
class BlockFamily:
    """One family of backbones: a block and the public model built from it.

    Args:
        name (`str`): The family's key, as `--model_type` and `build_tiny_pipeline(backbone=...)` take it.
        class_name (`str`): The public model's class name, as exported and recorded in `_class_name`.
        module (`str`): The module of `diffusers_lmlp.models` that defines the class (e.g. "mixers.gmlp").
        label (`str`): What cards, the Space and tables call it (e.g. "UL-MLP").
        paper (`str`): The paper that defines the block, as a Markdown link.
        tag (`str`): The Hub tag of its checkpoints.
        tiny_overrides (`dict`): Config values a tiny model of this family needs.
        details (`Callable[[Mapping], str]`): The family-specific part of a config in words, for cards.
        lora_target_modules (`tuple[str, ...]`): LoRA's default targets, regexes of `nn.Linear` names in a block.
        lora_target_parameters (`tuple[str, ...]`): 2-D weights used without an `nn.Linear` (the tied
            SymMixer/AsymMixer weights), for PEFT's `target_parameters`.
    """

    name: str
    class_name: str
    module: str
    label: str
    paper: str
    tag: str
    tiny_overrides: dict[str, Any] = field(default_factory=dict)
    details: Callable[[Mapping], str] = _no_details
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
        if not self.lora_target_modules:
            return None
        return rf".*\.(?:{'|'.join(self.lora_target_modules)})"

    def full_config(self, config: Mapping) -> dict[str, Any]:
        """A (possibly partial) config of `model_class`, completed with the `__init__` defaults."""
        parameters = inspect.signature(self.model_class.__init__).parameters.values()
        defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
        return {**defaults, **{k: v for k, v in config.items() if not k.startswith("_")}}


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _moe_details(config: Mapping) -> str:
    return f", {_count(config['num_experts'], 'expert')} × {_count(config['num_heads'], 'head')}"


def _uvit_details(config: Mapping) -> str:
    return f", {_count(config['num_attention_heads'], 'attention head')}"


_PARAMIXER_PAPER = (
    "[Hierarchical Associative Memory, Parallelized MLP-Mixer, and Symmetry Breaking]"
    "(https://arxiv.org/abs/2406.12220) (Karakida, Ota, Taki 2024)"
)

FAMILIES: dict[str, BlockFamily] = {
    family.name: family
    for family in (
        BlockFamily(
            name="lmlp",
            class_name="LMLPTransformer2DModel",
            module="lmlp_transformer_2d",
            label="UL-MLP",
            paper="[Lateralization MLP](https://arxiv.org/abs/2405.16098) (Hu & Rostami 2024)",
            tag="l-mlp",
            lora_target_modules=("left", "right", "merge", r"joint_mlp\.fc1", r"joint_mlp\.fc2"),
        ),
        BlockFamily(
            name="moe_mlp",
            class_name="MoEMLPModel",
            module="moe_mlp",
            label="MoE-MLP",
            paper='"Many Can Beat One: MoE-Linear Attention for Full MLP Image Generation"',
            tag="moe-mlp",
            tiny_overrides={"num_experts": 2, "num_heads": 2},
            details=_moe_details,
            lora_target_modules=(r"left\.gates\.\d+", "right", "merge", r"joint_mlp\.fc1", r"joint_mlp\.fc2"),
        ),
        BlockFamily(
            name="uvit",
            class_name="UViTTransformer2DModel",
            module="mixers.attention",
            label="U-ViT",
            paper="[U-ViT](https://arxiv.org/abs/2209.12152) (Bao et al. 2023)",
            tag="u-vit",
            details=_uvit_details,
            lora_target_modules=(r"attn\.qkv", r"attn\.proj", r"mlp\.fc1", r"mlp\.fc2", "skip_linear"),
        ),
        BlockFamily(
            name="mlp_mixer",
            class_name="MLPMixerTransformer2DModel",
            module="mixers.mlp_mixer",
            label="MLP-Mixer",
            paper="[MLP-Mixer](https://arxiv.org/abs/2105.01601) (Tolstikhin et al. 2021)",
            tag="mlp-mixer",
            lora_target_modules=(r"token_mlp\.fc[12]", r"channel_mlp\.fc[12]"),
        ),
        BlockFamily(
            name="paramixer",
            class_name="ParaMixerTransformer2DModel",
            module="mixers.paramixer",
            label="ParaMixer",
            paper=_PARAMIXER_PAPER,
            tag="paramixer",
            lora_target_modules=(r"token_mlp\.fc[12]", r"channel_mlp\.fc[12]"),
        ),
        BlockFamily(
            name="symmixer",
            class_name="SymMixerTransformer2DModel",
            module="mixers.paramixer",
            label="SymMixer",
            paper=_PARAMIXER_PAPER,
            tag="symmixer",
            lora_target_parameters=("token_mlp.weight", "channel_mlp.weight"),
        ),
        BlockFamily(
            name="asymmixer",
            class_name="AsymMixerTransformer2DModel",
            module="mixers.paramixer",
            label="AsymMixer",
            paper=_PARAMIXER_PAPER,
            tag="asymmixer",
            lora_target_modules=(r"token_mlp\.fc2", r"channel_mlp\.fc2"),
            lora_target_parameters=("token_mlp.weight", "channel_mlp.weight"),
        ),
        BlockFamily(
            name="gmlp",
            class_name="GMLPTransformer2DModel",
            module="mixers.gmlp",
            label="gMLP",
            paper="[gMLP](https://arxiv.org/abs/2105.08050) (Liu et al. 2021)",
            tag="gmlp",
            lora_target_modules=("channel_proj1", "channel_proj2", r"sgu\.spatial_proj"),
        ),
    )
}


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
    """Every named configuration of every family: name -> (family, `__init__` overrides)."""
    named: dict[str, tuple[BlockFamily, dict[str, Any]]] = {}
    for family in FAMILIES.values():
        for name, overrides in family.named_configs.items():
            if name in named:
                raise RuntimeError(
                    f"Named configuration {name!r} is defined by both {named[name][0].name} and "
                    f"{family.name}; names must be unique across families."
                )
            named[name] = (family, overrides)
    return named


def from_named_config(name: str, **overrides: Any) -> "UShapedMixerModel":
    """Build a randomly initialised backbone from any family's named configuration (e.g. "A2", "F2", "2E1H"), with
    `overrides` replacing config values (e.g. `sample_size=64`)."""
    named = named_configs()
    if name not in named:
        raise ValueError(f"Unknown named configuration {name!r}; choose one of {sorted(named)}.")
    family, _ = named[name]
    return family.model_class.from_named_config(name, **overrides)
