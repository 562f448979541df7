"""The emoji world: the Noto Color Emoji pictures with their Unicode and CLDR names, the real-picture world, with its
own trained VAE, CLIP (whose text tower is the pipeline's text encoder and whose image tower scores samples) and
shipped pipeline. Its names import lazily (`diffusers_lmlp.exports.lazy_exports`)."""

from typing import TYPE_CHECKING

from ..exports import lazy_exports


_MODULES = {
    ".world": ("HELD_OUT", "Emoji", "load_emoji", "load_images", "make_dataset", "split_indices", "tone_group"),
    ".scorer": ("EmojiScorer", "emoji_components", "pretrained_emoji_pipeline"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .scorer import EmojiScorer, emoji_components, pretrained_emoji_pipeline  # noqa: F401
    from .world import HELD_OUT, Emoji, load_emoji, load_images, make_dataset, split_indices, tone_group  # noqa: F401
