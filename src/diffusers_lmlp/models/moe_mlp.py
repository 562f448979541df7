"""`MoEMLPModel`: the full-MLP backbone of "Many Can Beat One: MoE-Linear Attention for Full MLP Image Generation"."""

from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.loaders import PeftAdapterMixin
from diffusers.utils import BaseOutput

from ..exports import public
from .backbone import UShapedMixerModel
from .catalog import NAMED_CONFIGS
from .mixers.moe import MoEMLPBlock
from .mixers.routing import collect_router_probs


@dataclass
class MoEMLPModelOutput(BaseOutput):
    """Output of `MoEMLPModel`: the (B, out_channels, H, W) ε prediction `sample` and, with `output_router_probs`,
    the (num_blocks, B, H, E) gate probabilities `router_probs` (for `load_balancing_loss`)."""

    sample: torch.Tensor
    router_probs: torch.Tensor | None = None


@public
class MoEMLPModel(UShapedMixerModel, ConfigMixin, PeftAdapterMixin):
    """The U-shaped MoE-MLP backbone: the UL-MLP whose token mixing is multi-head MoE-linear attention
    (`mixers.moe`); with one expert and one head it is the UL-MLP. The paper's models are the named configurations
    "2E1H", "4E1H" (the defaults) and "4E2H". LoRA can target `left.gates.<h>`, `right`, `merge` and
    `joint_mlp.fc1/fc2`; the experts only whole (`modules_to_save=["left"]`). Parameters are `UShapedMixerModel`'s
    (num_layers=16, mlp_ratio=4.0, norm_eps=1e-5), and `num_experts` E (L×L matrices, defaults to 4) and `num_heads`
    H (channel heads, each with its own experts and gate, defaults to 1)."""

    _no_split_modules = ["MoEMLPBlock"]
    _repeated_blocks = ["MoEMLPBlock"]
    named_configs = NAMED_CONFIGS["moe_mlp"]

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
        num_experts: int = 4,
        num_heads: int = 1,
        channel_mlp: str = "mlp",
        pooled_text_projection: bool = False,
    ):
        super().__init__()
        self._build(
            lambda seq_len, skip: MoEMLPBlock(
                hidden_size, seq_len, mlp_ratio, norm_eps, num_experts, num_heads, channel_mlp=self.channel_mlp_class()
            )
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor | float | int,
        output_router_probs: bool = False,
        return_dict: bool = True,
    ) -> MoEMLPModelOutput | tuple[torch.Tensor, ...]:
        """`UShapedMixerModel.forward`; with `output_router_probs` also every block's gate probabilities."""
        if output_router_probs:
            with collect_router_probs(self) as router_probs:
                sample = self._predict(hidden_states, encoder_hidden_states, timestep)
            router_probs = torch.stack(router_probs)  # (num_blocks, B, H, E), one Router per block
        else:
            sample, router_probs = self._predict(hidden_states, encoder_hidden_states, timestep), None
        if not return_dict:
            return (sample,) if router_probs is None else (sample, router_probs)
        return MoEMLPModelOutput(sample=sample, router_probs=router_probs)
