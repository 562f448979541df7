"""Publishing to the Hugging Face Hub: model cards, a saved pipeline or a LoRA adapter as a model repo, the demo as a
Space. Command line: `python -m diffusers_lmlp.hub push FOLDER owner/name [--with-code] [--dry-run]` and
`push-space owner/space --model owner/name` (also `diffusers-lmlp-hub`).

No upload follows a link or takes a credential-like file or one holding a token (`.upload`). Names import lazily.
"""

from typing import TYPE_CHECKING

from ..exports import lazy_exports


_EXPORTS = {
    "write_model_card": ".card",
    "push_lora": ".model",
    "stage_lora": ".model",
    "push_pipeline": ".model",
    "stage_pipeline": ".model",
    "push_space": ".space",
    "stage_space": ".space",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .card import write_model_card  # noqa: F401
    from .model import push_lora, push_pipeline, stage_lora, stage_pipeline  # noqa: F401
    from .space import push_space, stage_space  # noqa: F401
