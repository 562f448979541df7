"""The backbones, their block families and named configurations, and the reference-checkpoint converters; the
registry imports no model, the models import diffusers when first read (`lazy_exports`)."""

from typing import TYPE_CHECKING

from ..exports import lazy_exports


_EXPORTS = {
    "FAMILIES": ".families",
    "BlockFamily": ".families",
    "family_of": ".families",
    "from_named_config": ".families",
    "named_configs": ".families",
    "LMLPTransformer2DModel": ".lmlp_transformer_2d",
    "MoEMLPModel": ".mixers.moe",
    "MoEMLPModelOutput": ".mixers.moe",
    "convert_lmlp_reference_state_dict": ".lmlp_transformer_2d",
    "convert_uvit_reference_state_dict": ".mixers.attention",
    "load_balancing_loss": ".mixers.moe",
    "symmetry_breaking_penalty": ".mixers.paramixer",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .families import FAMILIES, BlockFamily, family_of, from_named_config, named_configs  # noqa: F401
    from .lmlp_transformer_2d import LMLPTransformer2DModel, convert_lmlp_reference_state_dict  # noqa: F401
    from .mixers.attention import convert_uvit_reference_state_dict  # noqa: F401
    from .mixers.moe import MoEMLPModel, MoEMLPModelOutput, load_balancing_loss  # noqa: F401
    from .mixers.paramixer import symmetry_breaking_penalty  # noqa: F401
