from .lora import LMLPLoraLoaderMixin
from .pipeline_lmlp import LMLPPipeline, default_scheduler
from .vocabulary import known_words, unknown_words


__all__ = ["LMLPLoraLoaderMixin", "LMLPPipeline", "default_scheduler", "known_words", "unknown_words"]
