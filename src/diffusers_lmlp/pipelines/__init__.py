"""The text-to-image pipeline, its LoRA loading, schedulers and vocabulary checks; names import lazily."""

from typing import TYPE_CHECKING

from ..exports import lazy_exports


_EXPORTS = {
    "LMLPLoraLoaderMixin": ".lora",
    "LMLPPipeline": ".pipeline_lmlp",
    "default_scheduler": ".schedulers",
    "known_words": ".vocabulary",
    "unknown_words": ".vocabulary",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .lora import LMLPLoraLoaderMixin  # noqa: F401
    from .pipeline_lmlp import LMLPPipeline  # noqa: F401
    from .schedulers import default_scheduler  # noqa: F401
    from .vocabulary import known_words, unknown_words  # noqa: F401
