"""`LMLPTransformer2DModel`: the U-shaped L-MLP ("UL-MLP") of Hu & Rostami 2024, and the reference-key converter."""

from collections.abc import Mapping

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin

from ..exports import public
from .backbone import CONFIG_REQUIREMENTS, UShapedMixerModel, _is_positive_real
from .catalog import NAMED_CONFIGS, TABLE_1  # noqa: F401  (TABLE_1: its former home)
from .mixers.lmlp import LATERAL_ACTIVATIONS, MERGINGS, SKIP_STAGES, LMLPBlock
from .reference_keys import rename_reference_keys


@public
class LMLPTransformer2DModel(UShapedMixerModel, ConfigMixin, PeftAdapterMixin):
    """The U-shaped L-MLP ("UL-MLP") text-to-image backbone ([Lateralization MLP](https://arxiv.org/abs/2405.16098)).

    The defaults build the paper's final model, Table 1's **F2-deep** (the reference `configs/lmlp_f2.py`):
    32×32×4 latents, patch 2, D = 512, 8 + 1 + 8 L-MLP blocks, MLP ratio 4, 77 CLIP ViT-L/14 tokens;
    47,139,122 parameters. The sequence length L = 1 + text_seq_len + (sample_size / patch_size)² (334 for F2-deep)
    is derived from the config. The other rows of the paper's design ablation (Table 1) are named configurations,
    built by `from_named_config` (the comment above `catalog.TABLE_1` says how each row is read and sized):

    | name | first stage (FNN_L, FNN_R) | merging | second stage | long skips | depth | params |
    |---|---|---|---|---|---|---|
    | A1, B1, B2 | MLPs, hidden 2× | Add / Prod / GLU, + Proj | none | none | 12 | 23,484,738 |
    | B3 | MLPs, hidden 2.35× | Add, no Proj | none | none | 12 | 23,464,237 |
    | A1-45M | MLPs, hidden 4.15× | Add + Proj | none | none | 12 | 44,386,684 |
    | C1 | MLPs, hidden 1× | Add + Proj | MLP, s = 4.49 | none | 12 | 44,385,046 |
    | D1, D2 | Linears | Prod / Add, + Proj | MLP, s = 5.2 | none | 12 | 44,366,248 |
    | E1, E2 | Linears, GELU on the left / both | Prod / Add, + Proj | MLP, s = 5.2 | none | 12 | 44,366,248 |
    | F1 | Linears | Add + Proj | MLP, s = 5.2 | into the first stage | 12 | 44,366,248 |
    | F2 | Linears | Add + Proj | MLP, s = 5.2 | second stage (reference) | 12 | 44,366,248 |
    | F2-deep | Linears | Add + Proj | MLP, s = 4 | second stage (reference) | 16 | 47,139,122 |

    Table 1's A2 (MLP-Mixer) and A3 (gMLP) are other block families: `MLPMixerTransformer2DModel` and
    `GMLPTransformer2DModel`.

    Every layer is called as a module, so PEFT adapters work as on diffusers' own transformers: each block's
    `nn.Linear` layers are `left` (the L×L token mixer, over the token axis), `right`, `merge`, `joint_mlp.fc1` and
    `joint_mlp.fc2`, e.g. `model.add_adapter(LoraConfig(r=8, target_modules=["left", "right", "merge"]))`.

    Parameters:
        sample_size (`int`, *optional*, defaults to 32): Side of the square latent.
        patch_size (`int`, *optional*, defaults to 2): Side of a square patch.
        in_channels (`int`, *optional*, defaults to 4): Latent channels.
        out_channels (`int`, *optional*): Prediction channels; `None` means `in_channels`.
        hidden_size (`int`, *optional*, defaults to 512): Token width D.
        num_layers (`int`, *optional*, defaults to 16): The reference "depth" (even): num_layers // 2 in-blocks,
            one mid-block and num_layers // 2 out-blocks.
        mlp_ratio (`float`, *optional*, defaults to 4.0): Joint-MLP (second stage, FNN_Z) hidden width as a
            multiple of D (the paper's s); `None`: no second stage (Table 1 A1, B1–B3).
        text_embed_dim (`int`, *optional*, defaults to 768): Width of the text encoder states.
        text_seq_len (`int`, *optional*, defaults to 77): Number of text tokens.
        conv_out (`bool`, *optional*, defaults to `True`): Apply the reference's final 3×3 convolution.
        norm_eps (`float`, *optional*, defaults to 1e-5): LayerNorm epsilon.
        lateral_mlp_ratio (`float`, *optional*): Make the first stage's FNN_L and FNN_R one-hidden-layer MLPs with
            this hidden width as a multiple of L and D (Table 1 A1, B1–B3, C1); `None`: single Linears.
        lateral_activation (`str`, *optional*, defaults to `"none"`): `"left"`: a GELU after the left Linear only
            (E1); `"both"`: after both (E2). Only with Linear branches.
        merging (`str`, *optional*, defaults to `"add"`): How the two hemispheres meet: `"add"`, `"prod"`
            (element-wise product) or `"glu"` (the left gated by the sigmoid of the right).
        merge_proj (`bool`, *optional*, defaults to `True`): Apply the merge Linear(D, D) (`False`: Table 1 B3).
        long_skip (`str`, *optional*, defaults to `"second_stage"`): Where an out block adds its long skip:
            `"second_stage"` (the reference: into the residual stream at the block's input), `"first_stage"` (into
            the two hemispheres only), or `None` (no long skips).
        channel_mlp (`str`, *optional*, defaults to `"mlp"`): The joint MLP, a key of
            `diffusers_lmlp.models.mixers.channel_mlp.CHANNEL_MLPS` (`"mlp"`: the transformer MLP).
        pooled_text_projection (`bool`, *optional*, defaults to `False`): Also add a Linear projection of the text
            encoder's last-position state (which a causal encoder computes from the whole caption) to every image
            token, beside the text tokens the blocks mix (`TokenEmbedder`). Not in the papers.
    """

    _no_split_modules = ["LMLPBlock"]
    _repeated_blocks = ["LMLPBlock"]
    config_requirements = {
        **CONFIG_REQUIREMENTS,
        "mlp_ratio": (
            lambda v: v is None or _is_positive_real(v),
            "a positive finite number or None (the joint MLP's width as a multiple of hidden_size; None: no "
            "second stage)",
        ),
        "lateral_mlp_ratio": (
            lambda v: v is None or _is_positive_real(v),
            "a positive finite number or None (the first stage's MLP width; None: Linear hemispheres)",
        ),
        "lateral_activation": (lambda v: v in LATERAL_ACTIVATIONS, f"one of {LATERAL_ACTIVATIONS}"),
        "merging": (lambda v: v in MERGINGS, f"one of {MERGINGS}"),
        "merge_proj": (lambda v: isinstance(v, bool), "True or False"),
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
                f"lateral_activation={lateral_activation!r} applies to Linear hemispheres (Table 1 E1, E2); with "
                f"lateral_mlp_ratio={lateral_mlp_ratio} the hemispheres are MLPs with their own GELU. Set "
                "lateral_mlp_ratio=None or lateral_activation='none'."
            )
        self._build(
            lambda seq_len, skip: LMLPBlock(
                hidden_size,
                seq_len,
                mlp_ratio,
                norm_eps,
                lateral_mlp_ratio=lateral_mlp_ratio,
                lateral_activation=lateral_activation,
                merging=merging,
                merge_proj=merge_proj,
                skip_stage=long_skip or "second_stage",
                channel_mlp=self.channel_mlp_class(),
            ),
        )

    @classmethod
    def long_skips(cls, config: Mapping) -> bool:
        """Out blocks receive long skips unless `long_skip` is `None`.

        Args:
            config (`Mapping`): A full config of this class.
        """
        return config["long_skip"] is not None


# Reference key (zizhao-hu/L-MLP `libs/f2.py`, §A.4) -> ours. Applied to the whole key, first match wins.
_REFERENCE_KEY_RULES = [
    (r"^pos_embed$", "embed.pos_embed"),
    (r"^patch_embed\.proj\.", "embed.patch_embed."),
    (r"^context_embed\.", "embed.text_adapter."),
    (r"^(in_blocks\.\d+|mid_block|out_blocks\.\d+)\.norm1\.", r"stack.\1.channel_norm."),
    (r"^(in_blocks\.\d+|mid_block|out_blocks\.\d+)\.norm2\.", r"stack.\1.token_norm."),
    (r"^(in_blocks\.\d+|mid_block|out_blocks\.\d+)\.l\.", r"stack.\1.left."),
    (r"^(in_blocks\.\d+|mid_block|out_blocks\.\d+)\.r\.", r"stack.\1.right."),
    (r"^(in_blocks\.\d+|mid_block|out_blocks\.\d+)\.proj\.", r"stack.\1.merge."),
    (r"^(in_blocks\.\d+|mid_block|out_blocks\.\d+)\.mlp\.", r"stack.\1.joint_mlp."),
    (r"^norm\.", "head.norm."),
    (r"^decoder_pred\.", "head.proj."),
    (r"^final_layer\.", "head.conv."),
]


def convert_lmlp_reference_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a state dict of the reference UL-MLP (`libs/f2.py` of zizhao-hu/L-MLP) to `LMLPTransformer2DModel`.

    | reference key | ours |
    |---|---|
    | `pos_embed` | `embed.pos_embed` |
    | `patch_embed.proj.*` | `embed.patch_embed.*` |
    | `context_embed.*` | `embed.text_adapter.*` |
    | `{in_blocks.i, mid_block, out_blocks.i}.norm1.*` | `stack.<same>.channel_norm.*` |
    | `….norm2.*` / `….l.*` / `….r.*` / `….proj.*` / `….mlp.fc{1,2}.*` | `….token_norm.*` / `….left.*` / `….right.*` / `….merge.*` / `….joint_mlp.fc{1,2}.*` |
    | `norm.*` / `decoder_pred.*` / `final_layer.*` | `head.norm.*` / `head.proj.*` / `head.conv.*` |

    Tensors are not copied or reshaped. A leading `module.` (a DDP-wrapped save) is stripped.

    Args:
        state_dict (`dict[str, torch.Tensor]`): The reference state dict (e.g. the `nnet_ema.pth` of a training
            run, loaded with `torch.load(path, weights_only=True)` or from a safetensors conversion).

    Returns:
        `dict[str, torch.Tensor]`: A state dict for `LMLPTransformer2DModel.load_state_dict`.

    Example:
        ```py
        model = LMLPTransformer2DModel()  # F2-deep, the reference configs/lmlp_f2.py
        model.load_state_dict(convert_lmlp_reference_state_dict(reference_state_dict))
        model.save_pretrained("ul-mlp-f2-deep")  # safetensors from here on
        ```
    """
    return rename_reference_keys(state_dict, _REFERENCE_KEY_RULES, _unexpected_key_error)


def _unexpected_key_error(key: str) -> ValueError:
    return ValueError(
        f"Unexpected key {key!r}: not part of the reference UL-MLP (libs/f2.py) layout. Is this an L-MLP "
        "checkpoint (a U-ViT one has attn.* and skip_linear.* keys)?"
    )
