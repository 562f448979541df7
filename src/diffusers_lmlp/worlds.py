"""The embedded worlds (shapes, emoji): what the trainer, the evaluation and the Space ask of each, named as
"module:attribute" and imported on first use."""

import functools
import importlib
import os
from dataclasses import dataclass
from pathlib import Path


def load(name: str):
    """The object a "module:attribute[.attribute]" name names."""
    module, attributes = name.split(":")
    return functools.reduce(getattr, attributes.split("."), importlib.import_module(module))


@dataclass(frozen=True)
class World:
    """One embedded world; `pipeline`, `components`, `scorer`, `is_caption`, `validation_prompts` and `clip_model`
    are "module:attribute" names (`load`)."""

    name: str  # the --preset, --pipeline, FID reference and caption source that stand for it
    description: str  # what a model card says the model was trained on
    pipeline: str  # the folder of its shipped pipeline
    components: str  # loads the frozen (tokenizer, text_encoder, vae) it trains on
    scorer: str
    is_caption: str
    validation_prompts: str  # the validation grid's captions: 6 training ones, then 2 held-out ones
    splits: dict[str, str]  # split its scores read -> its caption source (`draw_captions`)
    num_captions: int  # captions per split in a run's final evaluation
    validation_captions: int  # captions per split, one image each, in a validation's scores
    final_seeds: dict[str, int]  # images per caption, by split, in a run's final evaluation
    example_captions: tuple[str, ...]  # what a demo offers
    fid_features: str  # loads its FID feature network
    caption_items: str  # (count, caption(i), phrasing(i, rng)) of a split ("train", "heldout", None: all)
    clip_model: str | None = None  # the CLIP model whose score its evaluation reports
    fid_digits: int = 2  # the decimals its FID is shown with

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
        fid_features="diffusers_lmlp.shapes.features:pretrained_shapes_features",
        caption_items="diffusers_lmlp.shapes.world:caption_items",
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
        fid_features="diffusers_lmlp.emoji.scorer:emoji_features",
        caption_items="diffusers_lmlp.emoji.world:caption_items",
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


def is_repo_id(name: str) -> bool:
    """Whether `name` has the form of a Hub repo id, by huggingface_hub's rules."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def pipeline_problem(name: str) -> str | None:
    """Why `--pipeline name` names nothing (a file, or no folder and no Hub repo id); None if it may work."""
    if name in WORLDS or os.path.isdir(name):
        return None
    if os.path.exists(name):
        return f"--pipeline {name}: not a folder; pass a pipeline folder or a Hub repo id"
    return None if is_repo_id(name) else f"--pipeline {name}: no such folder"
