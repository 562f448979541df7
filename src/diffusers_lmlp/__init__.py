"""diffusers-lmlp: attention-free MLP diffusion backbones (L-MLP, MoE-MLP) for Hugging Face diffusers."""

import diffusers

# diffusers resolves a `model_index.json` entry ["diffusers_lmlp", "<Class>"] with `getattr(diffusers_lmlp, ...)`,
# and picks the loading method by looking up these base classes by name on the same module.
from diffusers import ConfigMixin, DiffusionPipeline, ModelMixin, SchedulerMixin  # noqa: F401

from .models import (
    FAMILIES,
    LMLPTransformer2DModel,
    MoEMLPModel,
    MoEMLPModelOutput,
    convert_lmlp_reference_state_dict,
    convert_uvit_reference_state_dict,
    from_named_config,
    load_balancing_loss,
    symmetry_breaking_penalty,
)
from .pipelines import LMLPLoraLoaderMixin, LMLPPipeline, default_scheduler, known_words, unknown_words


__version__ = "0.1.0.dev0"

__all__ = [
    "FAMILIES",
    "LMLPLoraLoaderMixin",
    "LMLPPipeline",
    "LMLPTransformer2DModel",
    "MoEMLPModel",
    "MoEMLPModelOutput",
    "convert_lmlp_reference_state_dict",
    "convert_uvit_reference_state_dict",
    "default_scheduler",
    "from_named_config",
    "known_words",
    "load_balancing_loss",
    "symmetry_breaking_penalty",
    "unknown_words",
]

# Every registered family's model is public here, whatever file defines it: diffusers resolves model_index.json's
# ["diffusers_lmlp", "<Class>"] as an attribute of this package.
for _family in FAMILIES.values():
    globals()[_family.model_class.__name__] = _family.model_class
    if _family.model_class.__name__ not in __all__:
        __all__.append(_family.model_class.__name__)
# `save_pretrained` records a component's `__module__`; pinning it to the package keeps model_index.json entries
# ["diffusers_lmlp", "<Class>"] valid however the modules are reorganised.
for _class in (*(family.model_class for family in FAMILIES.values()), LMLPPipeline):
    _class.__module__ = __name__
del _class, _family

# `DiffusionPipeline.from_pretrained` resolves `_class_name` as an attribute of the diffusers package: registering
# the pipeline there makes it work for our folders once `diffusers_lmlp` is imported.
if not hasattr(diffusers, LMLPPipeline.__name__):
    setattr(diffusers, LMLPPipeline.__name__, LMLPPipeline)
