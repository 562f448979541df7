from .pipeline_lmlp import LMLPPipeline, default_scheduler


__all__ = ["LMLPPipeline", "default_scheduler"]
