from .lmlp_transformer_2d import LMLPTransformer2DModel, convert_lmlp_reference_state_dict
from .mixers import load_balancing_loss
from .moe_mlp import MoEMLPModel, MoEMLPModelOutput


__all__ = [
    "LMLPTransformer2DModel",
    "MoEMLPModel",
    "MoEMLPModelOutput",
    "convert_lmlp_reference_state_dict",
    "load_balancing_loss",
]
