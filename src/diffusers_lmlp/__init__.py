"""diffusers-lmlp: attention-free MLP diffusion backbones (L-MLP, MoE-MLP) for Hugging Face diffusers.

Public names import lazily (`exports.lazy_exports`): diffusers, transformers and accelerate load only when needed.
"""

from typing import TYPE_CHECKING

from .exports import lazy_exports
from .models.families import FAMILIES
from .registration import register_with_diffusers


__version__ = "0.1.0.dev0"

_EXPORTS = {
    "FAMILIES": ".models.families",
    "from_named_config": ".models.families",
    "LMLPLoraLoaderMixin": ".pipelines.lora",
    "LMLPPipeline": ".pipelines.pipeline_lmlp",
    "default_scheduler": ".pipelines.schedulers",
    "known_words": ".pipelines.vocabulary",
    "unknown_words": ".pipelines.vocabulary",
    "MoEMLPModelOutput": ".models.mixers.moe",
    "convert_lmlp_reference_state_dict": ".models.lmlp_transformer_2d",
    "convert_uvit_reference_state_dict": ".models.mixers.attention",
    "load_balancing_loss": ".models.mixers.moe",
    "symmetry_breaking_penalty": ".models.mixers.paramixer",
    # Every family's model is public here: diffusers resolves model_index.json's ["diffusers_lmlp", "<Class>"] here.
    **{family.class_name: f".models.{family.module}" for family in FAMILIES.values()},
}
__all__ = sorted(_EXPORTS)
# diffusers looks these base classes up by name on a component's library (this package) to pick its loading method.
_EXPORTS.update(dict.fromkeys(("ConfigMixin", "DiffusionPipeline", "ModelMixin", "SchedulerMixin"), "diffusers"))

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

# `DiffusionPipeline.from_pretrained` resolves `_class_name` on the diffusers package: make `LMLPPipeline` found there.
register_with_diffusers()

if TYPE_CHECKING:
    from .models.families import from_named_config  # noqa: F401
    from .models.lmlp_transformer_2d import LMLPTransformer2DModel, convert_lmlp_reference_state_dict  # noqa: F401
    from .models.mixers.attention import convert_uvit_reference_state_dict  # noqa: F401
    from .models.mixers.moe import MoEMLPModel, MoEMLPModelOutput, load_balancing_loss  # noqa: F401
    from .models.mixers.paramixer import symmetry_breaking_penalty  # noqa: F401
    from .pipelines import LMLPLoraLoaderMixin, LMLPPipeline, default_scheduler, known_words, unknown_words  # noqa: F401
