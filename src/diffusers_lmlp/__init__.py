"""diffusers-lmlp: attention-free MLP diffusion backbones (L-MLP, MoE-MLP) for Hugging Face diffusers.

The public names import lazily (`exports.lazy_exports`): `import diffusers_lmlp` costs about what `import torch`
does, and diffusers, transformers and accelerate load when a model, the pipeline or a command's work needs them.
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
    "MoEMLPModelOutput": ".models.moe_mlp",
    "convert_lmlp_reference_state_dict": ".models.lmlp_transformer_2d",
    "convert_uvit_reference_state_dict": ".models.mixers.attention",
    "load_balancing_loss": ".models.mixers.moe",
    "symmetry_breaking_penalty": ".models.mixers.paramixer",
    # Every registered family's model is public here, whatever file defines it: diffusers resolves model_index.json's
    # ["diffusers_lmlp", "<Class>"] as an attribute of this package.
    **{family.class_name: f".models.{family.module}" for family in FAMILIES.values()},
}
__all__ = sorted(_EXPORTS)
# diffusers picks a component's loading method by looking up these base classes by name on the component's library
# (this package): they resolve to diffusers' own, without being public names of ours.
_EXPORTS.update(dict.fromkeys(("ConfigMixin", "DiffusionPipeline", "ModelMixin", "SchedulerMixin"), "diffusers"))

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

# `DiffusionPipeline.from_pretrained` resolves a folder's `_class_name` as an attribute of the diffusers package: this
# makes `LMLPPipeline` one, as soon as diffusers is imported (now, or whenever it is).
register_with_diffusers()

if TYPE_CHECKING:
    from .models import (  # noqa: F401
        LMLPTransformer2DModel,
        MoEMLPModel,
        MoEMLPModelOutput,
        convert_lmlp_reference_state_dict,
        convert_uvit_reference_state_dict,
        from_named_config,
        load_balancing_loss,
        symmetry_breaking_penalty,
    )
    from .pipelines import LMLPLoraLoaderMixin, LMLPPipeline, default_scheduler, known_words, unknown_words  # noqa: F401
