"""Publishing to the Hugging Face Hub: model cards, a saved pipeline or a LoRA adapter as a model repo, the demo as a
Space.

From the command line (`python -m diffusers_lmlp.hub --help`, or `diffusers-lmlp-hub`):

    python -m diffusers_lmlp.hub push lmlp-shapes owner/lmlp-shapes [--dry-run]
    python -m diffusers_lmlp.hub push lmlp-shapes owner/lmlp-shapes --with-code  # loads without the package
    python -m diffusers_lmlp.hub push lmlp-shapes-lora owner/lmlp-shapes-lora  # a LoRA adapter folder
    python -m diffusers_lmlp.hub push-space owner/lmlp-demo --model owner/lmlp-shapes [--dry-run]

No upload follows a symbolic or hard link, or takes a file named like a credential or holding a token; see
`diffusers_lmlp.hub.upload`.

Its names import lazily (`diffusers_lmlp.exports.lazy_exports`).
"""

from typing import TYPE_CHECKING

from ..exports import lazy_exports


_EXPORTS = {
    "write_model_card": ".card",
    "push_lora": ".lora_upload",
    "stage_lora": ".lora_upload",
    "push_pipeline": ".model",
    "stage_pipeline": ".model",
    "push_space": ".space",
    "stage_space": ".space",
}
__all__ = [
    "push_lora",
    "push_pipeline",
    "push_space",
    "stage_lora",
    "stage_pipeline",
    "stage_space",
    "write_model_card",
]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .card import write_model_card  # noqa: F401
    from .lora_upload import push_lora, stage_lora  # noqa: F401
    from .model import push_pipeline, stage_pipeline  # noqa: F401
    from .space import push_space, stage_space  # noqa: F401
