"""U-ViT (Bao et al. 2023), the attention baseline of the L-MLP and MoE-MLP papers, as the reference builds it:
pre-norm transformer blocks; out blocks concatenate their long skip and project it (`skip_linear`). Module names and
layouts are the reference's (baofff/U-ViT `libs/uvit_t2i.py`), so converting a checkpoint only renames it. Count MACs
on the meta device: torch has no formula for the CPU flash kernel.
"""

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from torch import nn

from ...exports import public
from ..backbone import BOOLEAN, CONFIG_REQUIREMENTS, UShapedMixerModel, _is_positive_int, rename_reference_keys
from ..catalog import NAMED_CONFIGS
from .channel_mlp import JointMLP


class UViTAttention(nn.Module):
    """Multi-head self-attention over all L tokens, the reference's `Attention` (no dropout); H must divide D."""

    def __init__(self, hidden_size: int, num_heads: int, qkv_bias: bool = False):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(
                f"hidden_size ({hidden_size}) must be divisible by num_attention_heads ({num_heads}); pick one of "
                f"its divisors (U-ViT-S/2: 8 heads of 64 channels)."
            )
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=qkv_bias)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, seq_len, hidden_size = x.shape
        qkv = self.qkv(x).reshape(batch_size, seq_len, 3, self.num_heads, -1)  # (B, L, 3, H, D/H)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 × (B, H, L, D/H)
        x = F.scaled_dot_product_attention(query, key, value)  # (B, H, L, D/H), scale (D/H)^-0.5
        x = x.transpose(1, 2).reshape(batch_size, seq_len, hidden_size)  # (B, L, D), head-major channels
        return self.proj(x)


class UViTBlock(nn.Module):
    """One U-ViT block, `block(x, skip) -> x` on (B, L, D); an out block merges the long skip with `skip_linear`."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        mlp_ratio: float,
        norm_eps: float,
        qkv_bias: bool = False,
        skip: bool = False,
        channel_mlp: Callable[[int, float], nn.Module] = JointMLP,
    ):
        super().__init__()
        self.skip_linear = nn.Linear(2 * hidden_size, hidden_size) if skip else None
        self.norm1 = nn.LayerNorm(hidden_size, eps=norm_eps)
        self.attn = UViTAttention(hidden_size, num_heads, qkv_bias)
        self.norm2 = nn.LayerNorm(hidden_size, eps=norm_eps)
        self.mlp = channel_mlp(hidden_size, mlp_ratio)

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        if (skip is None) != (self.skip_linear is None):
            raise ValueError(
                "Only a U-ViT out block (skip=True) takes a long skip; this block has skip_linear="
                f"{self.skip_linear is not None} but got skip={'None' if skip is None else 'a tensor'}."
            )
        if self.skip_linear is not None:
            x = self.skip_linear(torch.cat([x, skip], dim=-1))  # (B, L, 2D) -> (B, L, D)
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


@public
class UViTTransformer2DModel(UShapedMixerModel, ConfigMixin, PeftAdapterMixin):
    """The U-ViT text-to-image backbone ([U-ViT](https://arxiv.org/abs/2209.12152)), exactly the reference
    `libs/uvit_t2i.py`. The defaults build U-ViT-S/2 for MS-COCO; "U-ViT-S/2-deep" (depth 16) is a named
    configuration; `convert_uvit_reference_state_dict` loads the published weights. LoRA can target `attn.qkv`,
    `attn.proj`, `mlp.fc1/fc2` and `skip_linear`. Parameters are `UShapedMixerModel`'s (num_layers=12, mlp_ratio=4.0,
    norm_eps=1e-5) with `channel_mlp`, and `num_attention_heads` (defaults to 8; must divide `hidden_size`) and
    `qkv_bias` (defaults to `False`)."""

    _no_split_modules = ["UViTBlock"]
    _repeated_blocks = ["UViTBlock"]
    config_requirements = {
        **CONFIG_REQUIREMENTS,
        "num_attention_heads": (_is_positive_int, "a positive integer (the attention heads; it must divide D)"),
        "qkv_bias": BOOLEAN,
    }
    named_configs = NAMED_CONFIGS["uvit"]

    @register_to_config
    def __init__(
        self,
        sample_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        out_channels: int | None = None,
        hidden_size: int = 512,
        num_layers: int = 12,
        mlp_ratio: float = 4.0,
        text_embed_dim: int = 768,
        text_seq_len: int = 77,
        conv_out: bool = True,
        norm_eps: float = 1e-5,
        num_attention_heads: int = 8,
        qkv_bias: bool = False,
        channel_mlp: str = "mlp",
        pooled_text_projection: bool = False,
    ):
        super().__init__()
        self._build(
            lambda seq_len, skip: UViTBlock(
                hidden_size,
                num_attention_heads,
                mlp_ratio,
                norm_eps,
                qkv_bias=qkv_bias,
                skip=skip,
                channel_mlp=self.channel_mlp_class(),
            )
        )


_BLOCK = r"in_blocks\.\d+|mid_block|out_blocks\.\d+"
_BLOCK_LAYER = r"norm1|norm2|attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2"
# Reference key (baofff/U-ViT `libs/uvit_t2i.py`) -> ours. Applied to the whole key, first match wins.
_REFERENCE_KEY_RULES = [
    (r"^pos_embed$", "embed.pos_embed"),
    (r"^patch_embed\.proj\.(weight|bias)$", r"embed.patch_embed.\1"),
    (r"^context_embed\.(weight|bias)$", r"embed.text_adapter.\1"),
    (rf"^({_BLOCK})\.((?:{_BLOCK_LAYER})\.(?:weight|bias))$", r"stack.\1.\2"),
    (r"^(out_blocks\.\d+)\.(skip_linear\.(?:weight|bias))$", r"stack.\1.\2"),
    (r"^norm\.(weight|bias)$", r"head.norm.\1"),
    (r"^decoder_pred\.(weight|bias)$", r"head.proj.\1"),
    (r"^final_layer\.(weight|bias)$", r"head.conv.\1"),
]
# Keys of the reference UL-MLP block (libs/f2.py), which shares every top-level key with U-ViT.
_LMLP_BLOCK_KEY = re.compile(rf"^({_BLOCK})\.(l|r|proj)\.(weight|bias)$")


def _unexpected_key_error(key: str) -> ValueError:
    """The error for a key that no rule maps, naming what the checkpoint most likely is."""
    if _LMLP_BLOCK_KEY.match(key):
        cause = "This looks like an L-MLP checkpoint (libs/f2.py): load it with convert_lmlp_reference_state_dict."
    elif re.match(rf"^({_BLOCK})\.skip_linear\.", key):
        cause = "Only out blocks have a skip_linear: the block numbering of this checkpoint is not U-ViT's."
    elif re.match(r"^(time_embed|label_emb|token_embedding|clip_img_embed|text_embed)\.", key):
        cause = "This looks like another U-ViT (libs/uvit.py, a time-MLP variant or UniDiffuser), not uvit_t2i.py's."
    else:
        cause = "Pass the network's own state dict (e.g. nnet_ema.pth), not an optimizer state or a wrapping dict."
    return ValueError(
        f"Unexpected key {key!r}: not part of the reference U-ViT text-to-image layout (libs/uvit_t2i.py). {cause}"
    )


def convert_uvit_reference_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a state dict of the reference U-ViT (`libs/uvit_t2i.py`) to `UViTTransformer2DModel`'s keys, less a DDP
    `module.` prefix; any other key raises a `ValueError` naming what the checkpoint most likely is.

    Example (the published checkpoints are pickled, and this package never unpickles: load a file you trust):

        ```py
        reference = torch.load("mscoco_uvit_small.pth", map_location="cpu", weights_only=True)
        model = UViTTransformer2DModel.from_named_config("U-ViT-S/2")
        model.load_state_dict(convert_uvit_reference_state_dict(reference))
        model.save_pretrained("uvit-s2-mscoco")  # safetensors from here on
        ```
    """
    return rename_reference_keys(state_dict, _REFERENCE_KEY_RULES, _unexpected_key_error)
