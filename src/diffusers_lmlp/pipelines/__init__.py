"""The text-to-image pipeline, its LoRA loading, the schedulers it samples with and its vocabulary checks.

Its names import lazily (`diffusers_lmlp.exports.lazy_exports`).
"""

from typing import TYPE_CHECKING

from ..exports import lazy_exports


_EXPORTS = {
    "LMLPLoraLoaderMixin": ".lora",
    "LMLPPipeline": ".pipeline_lmlp",
    "default_scheduler": ".schedulers",
    "known_words": ".vocabulary",
    "unknown_words": ".vocabulary",
}
__all__ = ["LMLPLoraLoaderMixin", "LMLPPipeline", "default_scheduler", "known_words", "unknown_words"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .lora import LMLPLoraLoaderMixin  # noqa: F401
    from .pipeline_lmlp import LMLPPipeline  # noqa: F401
    from .schedulers import default_scheduler  # noqa: F401
    from .vocabulary import known_words, unknown_words  # noqa: F401
