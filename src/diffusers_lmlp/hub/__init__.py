"""Publishing to the Hugging Face Hub: model cards, a saved pipeline or a LoRA adapter as a model repo, the demo as a
Space.

From the command line (`python -m diffusers_lmlp.hub --help`, or `diffusers-lmlp-hub`):

    python -m diffusers_lmlp.hub push lmlp-shapes owner/lmlp-shapes [--dry-run]
    python -m diffusers_lmlp.hub push lmlp-shapes owner/lmlp-shapes --with-code  # loads without the package
    python -m diffusers_lmlp.hub push lmlp-shapes-lora owner/lmlp-shapes-lora  # a LoRA adapter folder
    python -m diffusers_lmlp.hub push-space owner/lmlp-demo --model owner/lmlp-shapes [--dry-run]

No upload follows a symbolic link or takes a file named like a credential; see `diffusers_lmlp.hub.upload`.
"""

from .card import write_model_card
from .lora_upload import push_lora, stage_lora
from .model import push_pipeline, stage_pipeline
from .space import push_space, stage_space


__all__ = [
    "push_lora",
    "push_pipeline",
    "push_space",
    "stage_lora",
    "stage_pipeline",
    "stage_space",
    "write_model_card",
]
