"""`LMLPTransformer2DModel`: the U-shaped L-MLP ("UL-MLP") of Hu & Rostami 2024, and the reference-key converter."""

from collections.abc import Mapping

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin

from ..exports import public
from .backbone import BOOLEAN, CONFIG_REQUIREMENTS, UShapedMixerModel, _is_positive_real, rename_reference_keys
from .catalog import NAMED_CONFIGS
from .mixers.lmlp import LATERAL_ACTIVATIONS, MERGINGS, SKIP_STAGES, LMLPBlock


def _is_ratio_or_none(value) -> bool:
    return value is None or _is_positive_real(value)


@public
class LMLPTransformer2DModel(UShapedMixerModel, ConfigMixin, PeftAdapterMixin):
    """The U-shaped L-MLP ("UL-MLP") text-to-image backbone ([Lateralization MLP](https://arxiv.org/abs/2405.16098)).

    The defaults build the paper's final model, Table 1's F2-deep (the reference `configs/lmlp_f2.py`); the other
    rows are named configurations. Parameters are `UShapedMixerModel`'s (num_layers=16, mlp_ratio=4.0 or `None` for
    no second stage, norm_eps=1e-5), and:

        lateral_mlp_ratio (`float`, *optional*): FNN_L and FNN_R as one-hidden-layer MLPs of this ratio, not Linears.
        lateral_activation (`str`, defaults to `"none"`): GELU after the `"left"` Linear (E1) or `"both"`.
        merging (`str`, defaults to `"add"`): How the hemispheres meet: `"add"`, `"prod"` or `"glu"`.
        merge_proj (`bool`, defaults to `True`): Apply the merge Linear(D, D) (`False`: Table 1 B3).
        long_skip (`str`, defaults to `"second_stage"`): Where out blocks add their long skip: the residual stream
            (`"second_stage"`, the reference), the hemispheres only (`"first_stage"`), or `None`.
    """

    _no_split_modules = ["LMLPBlock"]
    _repeated_blocks = ["LMLPBlock"]
    config_requirements = {
        **CONFIG_REQUIREMENTS,
        "mlp_ratio": (_is_ratio_or_none, "a positive finite number or None (no second stage)"),
        "lateral_mlp_ratio": (_is_ratio_or_none, "a positive finite number or None (Linear hemispheres)"),
        "lateral_activation": (lambda v: v in LATERAL_ACTIVATIONS, f"one of {LATERAL_ACTIVATIONS}"),
        "merging": (lambda v: v in MERGINGS, f"one of {MERGINGS}"),
        "merge_proj": BOOLEAN,
        "long_skip": (lambda v: v is None or v in SKIP_STAGES, f"one of {SKIP_STAGES} or None"),
    }
    named_configs = NAMED_CONFIGS["lmlp"]

    @register_to_config
    def __init__(
        self,
        sample_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        out_channels: int | None = None,
        hidden_size: int = 512,
        num_layers: int = 16,
        mlp_ratio: float | None = 4.0,
        text_embed_dim: int = 768,
        text_seq_len: int = 77,
        conv_out: bool = True,
        norm_eps: float = 1e-5,
        lateral_mlp_ratio: float | None = None,
        lateral_activation: str = "none",
        merging: str = "add",
        merge_proj: bool = True,
        long_skip: str | None = "second_stage",
        channel_mlp: str = "mlp",
        pooled_text_projection: bool = False,
    ):
        super().__init__()
        if lateral_mlp_ratio is not None and lateral_activation != "none":
            raise ValueError(
                f"lateral_activation={lateral_activation!r} applies to Linear hemispheres (Table 1 E1, E2), not to "
                f"lateral_mlp_ratio={lateral_mlp_ratio}'s MLPs; set lateral_mlp_ratio=None or lateral_activation='none'."
            )
        self._build(
            lambda seq_len, skip: LMLPBlock(
                hidden_size, seq_len, mlp_ratio, norm_eps, lateral_mlp_ratio=lateral_mlp_ratio,
                lateral_activation=lateral_activation, merging=merging, merge_proj=merge_proj,
                skip_stage=long_skip or "second_stage", channel_mlp=self.channel_mlp_class(),
            )
        )  # fmt: skip

    @classmethod
    def long_skips(cls, config: Mapping) -> bool:
        """Out blocks receive long skips unless `long_skip` is `None`."""
        return config["long_skip"] is not None


_LMLP_BLOCK = r"^(in_blocks\.\d+|mid_block|out_blocks\.\d+)\."
# Reference key (zizhao-hu/L-MLP `libs/f2.py`) -> ours. Applied to the whole key, first match wins.
_REFERENCE_KEY_RULES = [
    (r"^pos_embed$", "embed.pos_embed"),
    (r"^patch_embed\.proj\.", "embed.patch_embed."),
    (r"^context_embed\.", "embed.text_adapter."),
    *((_LMLP_BLOCK + theirs, rf"stack.\1.{ours}.") for theirs, ours in [
        (r"norm1\.", "channel_norm"), (r"norm2\.", "token_norm"), (r"l\.", "left"), (r"r\.", "right"),
        (r"proj\.", "merge"), (r"mlp\.", "joint_mlp"),
    ]),
    (r"^norm\.", "head.norm."),
    (r"^decoder_pred\.", "head.proj."),
    (r"^final_layer\.", "head.conv."),
]  # fmt: skip


def convert_lmlp_reference_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a state dict of the reference UL-MLP (`libs/f2.py` of zizhao-hu/L-MLP, e.g. a run's `nnet_ema.pth`) to
    `LMLPTransformer2DModel`'s keys; tensors are not copied, a DDP `module.` prefix is stripped."""
    return rename_reference_keys(state_dict, _REFERENCE_KEY_RULES, lambda key: ValueError(
        f"Unexpected key {key!r}: not part of the reference UL-MLP (libs/f2.py) layout. Is this an L-MLP "
        "checkpoint (a U-ViT one has attn.* and skip_linear.* keys)?"
    ))  # fmt: skip
