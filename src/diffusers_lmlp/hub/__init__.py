"""Publishing to the Hub: model cards, a saved pipeline or a LoRA adapter as a model repo, the demo as a Space
(`python -m diffusers_lmlp.hub push|push-space`). No upload follows a link or takes a credential-like file or one
holding a token (`.upload`). Names import lazily."""

from typing import TYPE_CHECKING

from ..exports import lazy_exports


_MODULES = {
    ".card": ("write_model_card",),
    ".model": ("push_lora", "stage_lora", "push_pipeline", "stage_pipeline"),
    ".space": ("push_space", "stage_space"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .card import write_model_card  # noqa: F401
    from .model import push_lora, push_pipeline, stage_lora, stage_pipeline  # noqa: F401
    from .space import push_space, stage_space  # noqa: F401
