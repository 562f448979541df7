from .families import FAMILIES, BlockFamily, family_of, from_named_config, named_configs
from .lmlp_transformer_2d import LMLPTransformer2DModel, convert_lmlp_reference_state_dict
from .mixers import load_balancing_loss
from .mixers.attention import convert_uvit_reference_state_dict
from .mixers.paramixer import symmetry_breaking_penalty
from .moe_mlp import MoEMLPModel, MoEMLPModelOutput


__all__ = [
    "FAMILIES",
    "BlockFamily",
    "family_of",
    "from_named_config",
    "named_configs",
    "LMLPTransformer2DModel",
    "MoEMLPModel",
    "MoEMLPModelOutput",
    "convert_lmlp_reference_state_dict",
    "convert_uvit_reference_state_dict",
    "load_balancing_loss",
    "symmetry_breaking_penalty",
]
