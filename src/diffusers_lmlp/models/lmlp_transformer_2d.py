"""`LMLPTransformer2DModel`: the U-shaped L-MLP ("UL-MLP") of Hu & Rostami 2024, and the reference-key converter."""

import re

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from .backbone import SHAPES_SMALL, UShapedMixerModel
from .mixers.lmlp import LMLPBlock


class LMLPTransformer2DModel(UShapedMixerModel, ConfigMixin, PeftAdapterMixin):
    """The U-shaped L-MLP text-to-image backbone ([Lateralization MLP](https://arxiv.org/abs/2405.16098)).

    The defaults build the paper's F2 model (the reference `configs/lmlp_f2.py`, called F2-deep in the paper):
    32×32×4 latents, patch 2, D = 512, 8 + 1 + 8 L-MLP blocks, MLP ratio 4, 77 CLIP ViT-L/14 tokens;
    47,139,122 parameters. The sequence length L = 1 + text_seq_len + (sample_size / patch_size)² (334 for F2)
    is derived from the config.

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
        mlp_ratio (`float`, *optional*, defaults to 4.0): Joint-MLP hidden width as a multiple of D (the paper's s).
        text_embed_dim (`int`, *optional*, defaults to 768): Width of the text encoder states.
        text_seq_len (`int`, *optional*, defaults to 77): Number of text tokens.
        conv_out (`bool`, *optional*, defaults to `True`): Apply the reference's final 3×3 convolution.
        norm_eps (`float`, *optional*, defaults to 1e-5): LayerNorm epsilon.
    """

    _no_split_modules = ["LMLPBlock"]
    _repeated_blocks = ["LMLPBlock"]
    named_configs = {
        "F2": {},  # the reference configs/lmlp_f2.py: the defaults
        "shapes-S": SHAPES_SMALL,  # the shapes world's small model
    }

    @register_to_config
    def __init__(
        self,
        sample_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        out_channels: int | None = None,
        hidden_size: int = 512,
        num_layers: int = 16,
        mlp_ratio: float = 4.0,
        text_embed_dim: int = 768,
        text_seq_len: int = 77,
        conv_out: bool = True,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        self._build(lambda seq_len: LMLPBlock(hidden_size, seq_len, mlp_ratio, norm_eps))

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor | float | int,
        return_dict: bool = True,
    ) -> Transformer2DModelOutput | tuple[torch.Tensor]:
        """Predict the noise ε of a noisy latent.

        Args:
            hidden_states (`torch.Tensor`): (B, in_channels, sample_size, sample_size) noisy latents.
            encoder_hidden_states (`torch.Tensor`): (B, text_seq_len, text_embed_dim) text encoder states (CLIP's
                last hidden state; the states of "" for the unconditional branch).
            timestep (`torch.Tensor` or `float` or `int`): Scalar or (B,) diffusers scheduler timesteps t in
                [0, 999]. The network embeds t + 1, the reference's timestep n (its ᾱ_n is diffusers'
                `alphas_cumprod[t]`), so converted reference weights run unchanged under diffusers schedulers.
            return_dict (`bool`, *optional*, defaults to `True`): Return a `Transformer2DModelOutput` rather than a
                tuple.

        Returns:
            [`~models.modeling_outputs.Transformer2DModelOutput`] or `tuple`: `sample` is the ε prediction
            (B, out_channels, sample_size, sample_size).
        """
        sample, _ = self._predict(hidden_states, encoder_hidden_states, timestep)
        if not return_dict:
            return (sample,)
        return Transformer2DModelOutput(sample=sample)


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
        model = LMLPTransformer2DModel()  # F2
        model.load_state_dict(convert_lmlp_reference_state_dict(reference_state_dict))
        model.save_pretrained("ul-mlp-f2")  # safetensors from here on
        ```
    """
    converted = {}
    for key, tensor in state_dict.items():
        key = key.removeprefix("module.")
        for pattern, replacement in _REFERENCE_KEY_RULES:
            new_key, count = re.subn(pattern, replacement, key)
            if count:
                converted[new_key] = tensor
                break
        else:
            raise ValueError(
                f"Unexpected key {key!r}: not part of the reference UL-MLP (libs/f2.py) layout. Is this an L-MLP "
                "checkpoint (a U-ViT one has attn.* and skip_linear.* keys)?"
            )
    return converted
