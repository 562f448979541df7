"""The embedded worlds, in one place: what the trainer, the evaluation and the Space ask of the shapes world and of
the emoji world (their data, frozen components, shipped pipeline, scored captions and scorer).

Each world's code stays in its package (`diffusers_lmlp.shapes`, `diffusers_lmlp.emoji`), named here as
"module:attribute" and imported on first use.
"""

import functools
import importlib
from dataclasses import dataclass
from pathlib import Path


def load(name: str):
    """The object a "module:attribute[.attribute]" name names."""
    module, attributes = name.split(":")
    return functools.reduce(getattr, attributes.split("."), importlib.import_module(module))


@dataclass(frozen=True)
class World:
    """One embedded world.

    Args:
        name (`str`): Its name: the `--preset`, `--pipeline`, FID reference and caption source that stand for it.
        description (`str`): What a model card says the model was trained on.
        pipeline (`str`): The folder of its shipped pipeline.
        components (`str`): The function that loads the frozen `(tokenizer, text_encoder, vae)` it trains on.
        scorer (`str`): The function that loads its scorer (`flags`, `renders`, `accuracies`, `intervals` and
            `FLAGS`, the names of what it says of an image).
        is_caption (`str`): The function that tells whether a caption is one of the world's.
        validation_prompts (`str`): The function that gives the validation grid's captions: 6 training captions,
            then 2 held-out ones.
        splits (`dict[str, str]`): The splits its scores read → their caption sources (`draw_captions`).
        num_captions (`int`): Captions per split in a run's final evaluation (drawn evenly from the split).
        validation_captions (`int`): Captions per split, one image each, in the scores of a run's validations.
        final_seeds (`dict[str, int]`): Images per caption, by split, in a run's final evaluation.
        example_captions (`tuple[str, ...]`): Captions a demo offers.
        clip_model (`str`, *optional*): The CLIP model whose score its evaluation reports.
        fid_digits (`int`, *optional*, defaults to 2): The decimals its FID is shown with.
    """

    name: str
    description: str
    pipeline: str
    components: str
    scorer: str
    is_caption: str
    validation_prompts: str
    splits: dict[str, str]
    num_captions: int
    validation_captions: int
    final_seeds: dict[str, int]
    example_captions: tuple[str, ...]
    clip_model: str | None = None
    fid_digits: int = 2

    @property
    def pipeline_path(self) -> Path:
        return load(self.pipeline)


WORLDS = {
    "shapes": World(
        name="shapes",
        description="the procedural shapes world",
        pipeline="diffusers_lmlp.shapes.pretrained:PIPELINE_PATH",
        components="diffusers_lmlp.shapes.text:shapes_components",
        scorer="diffusers_lmlp.shapes.scorer:ShapesScorer",
        is_caption="diffusers_lmlp.shapes.scorer:is_shapes_caption",
        validation_prompts="diffusers_lmlp.shapes.world:validation_prompts",
        splits={"train": "shapes:train", "held-out": "shapes:heldout"},
        num_captions=32,  # as many as there are held-out combinations
        validation_captions=32,
        final_seeds={"train": 3, "held-out": 4},
        example_captions=(
            "a small red circle at the top left",
            "a large blue square at the center",
            "green triangle, bottom right",
        ),
    ),
    "emoji": World(
        name="emoji",
        description="the emoji world (the Noto Color Emoji pictures and their Unicode names)",
        pipeline="diffusers_lmlp.emoji.scorer:PIPELINE_PATH",
        components="diffusers_lmlp.emoji.scorer:emoji_components",
        scorer="diffusers_lmlp.emoji.scorer:EmojiScorer.from_pretrained",
        is_caption="diffusers_lmlp.emoji.scorer:is_emoji_caption",
        validation_prompts="diffusers_lmlp.emoji.world:validation_prompts",
        splits={"train": "emoji:train", "held-out": "emoji:heldout"},
        num_captions=162,  # as many as there are held-out tone variants
        validation_captions=32,
        final_seeds={"train": 2, "held-out": 2},
        example_captions=("red apple", "grinning face", "a rocket emoji", "surfer: dark skin tone"),
        clip_model="diffusers_lmlp.emoji.scorer:CLIP_PATH",
        fid_digits=3,  # of unit CLIP embeddings: a few hundredths
    ),
}


def world_of(captions: list[str]) -> World | None:
    """The world whose captions these all are, if any: its scorer then reads the images."""
    for world in WORLDS.values():
        is_caption = load(world.is_caption)
        if all(is_caption(caption) for caption in captions):
            return world
    return None
