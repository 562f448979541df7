"""The backbones, their block families and named configurations, and the reference-checkpoint converters; the
registry imports no model, the models import diffusers when first read (`lazy_exports`)."""

from typing import TYPE_CHECKING

from ..exports import lazy_exports


_MODULES = {
    ".families": ("FAMILIES", "BlockFamily", "family_of", "from_named_config", "named_configs"),
    ".lmlp_transformer_2d": ("LMLPTransformer2DModel", "convert_lmlp_reference_state_dict"),
    ".mixers.attention": ("convert_uvit_reference_state_dict",),
    ".mixers.moe": ("MoEMLPModel", "MoEMLPModelOutput", "load_balancing_loss"),
    ".mixers.paramixer": ("symmetry_breaking_penalty",),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .families import FAMILIES, BlockFamily, family_of, from_named_config, named_configs  # noqa: F401
    from .lmlp_transformer_2d import LMLPTransformer2DModel, convert_lmlp_reference_state_dict  # noqa: F401
    from .mixers.attention import convert_uvit_reference_state_dict  # noqa: F401
    from .mixers.moe import MoEMLPModel, MoEMLPModelOutput, load_balancing_loss  # noqa: F401
    from .mixers.paramixer import symmetry_breaking_penalty  # noqa: F401
