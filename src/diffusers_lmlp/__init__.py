"""diffusers-lmlp: attention-free MLP diffusion backbones (L-MLP, MoE-MLP) for Hugging Face diffusers."""

from .models import (
    LMLPTransformer2DModel,
    MoEMLPModel,
    MoEMLPModelOutput,
    convert_lmlp_reference_state_dict,
    load_balancing_loss,
)


__version__ = "0.1.0.dev0"

__all__ = [
    "LMLPTransformer2DModel",
    "MoEMLPModel",
    "MoEMLPModelOutput",
    "convert_lmlp_reference_state_dict",
    "load_balancing_loss",
]
