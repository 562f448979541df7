"""The model card of a LoRA adapter folder (the trainer's `--lora_rank` output): what it adapts, how well, how to load
it. A push updates its `usage` block."""

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

from huggingface_hub import ModelCard

from ..models.families import family_of
from ..shapes.pretrained import PIPELINE_PATH as SHAPES_PIPELINE_PATH
from .card import GENERIC_PROMPT, data_source, hub_id_or_none, sample_line, save_card


# The adapter's name inside the model while training (PEFT's default); files carry no adapter name.
ADAPTER_NAME = "default"
# The path of a block in the backbone (`UShapedMixerModel.stack`), before a module's name inside the block.
BLOCK_PREFIX = re.compile(r"^stack\.(?:(?:in|out)_blocks\.\d+|mid_block)\.")
# How a summary names the shipped shapes model as a base: by the function that loads it, not by its local path.
SHIPPED_SHAPES_MODEL = "diffusers_lmlp.shapes.pretrained_shapes_pipeline()"


def adapted_modules(model) -> list[str]:
    """The modules an adapter adapts in `model`, named as without adapters (PEFT's wrappers add `base_layer`)."""
    names = (name.split(".lora_")[0] for name, _ in model.named_parameters() if ".lora_" in name)
    return list(dict.fromkeys(".".join(part for part in name.split(".") if part != "base_layer") for name in names))


def names_in_block(names: list[str]) -> list[str]:
    """The names of modules inside the stack's blocks, less the block's path (`joint_mlp.fc1`), once each, in order."""
    inside = (BLOCK_PREFIX.sub("", name) for name in names if BLOCK_PREFIX.match(name))
    return list(dict.fromkeys(inside))


def is_shipped_shapes_model(base_model: str) -> bool:
    """Whether `base_model` (a folder, repo id or `SHIPPED_SHAPES_MODEL`) is the shapes model the package ships."""
    return base_model == SHIPPED_SHAPES_MODEL or Path(base_model).resolve() == SHAPES_PIPELINE_PATH.resolve()


def recorded_base_model(base_model: str) -> str:
    """How a LoRA run's summary records its base pipeline: `SHIPPED_SHAPES_MODEL`, or the folder or repo id given."""
    return SHIPPED_SHAPES_MODEL if is_shipped_shapes_model(base_model) else base_model


def load_base_code(base_model: str) -> str:
    """The Python lines that load the base pipeline as `pipe`."""
    if is_shipped_shapes_model(base_model):
        return "from diffusers_lmlp.shapes import pretrained_shapes_pipeline\npipe = pretrained_shapes_pipeline()"
    return f"from diffusers_lmlp import LMLPPipeline\npipe = LMLPPipeline.from_pretrained({json.dumps(base_model)})"


def public_base_model(base_model: str) -> str:
    """How a card and an uploaded summary name a base: a Hub repo id, `SHIPPED_SHAPES_MODEL`, or a folder's name."""
    if is_shipped_shapes_model(base_model):
        return SHIPPED_SHAPES_MODEL
    return hub_id_or_none(base_model) or Path(base_model).name


def score_table(summary: Mapping) -> list[str]:
    """The scorer's accuracies of the base and the adapted model per split (`scores_before`, `scores`), as a table."""
    after, before = summary["scores"], summary["scores_before"]
    splits = list(after)
    metrics = list(dict.fromkeys(metric for split in splits for metric in after[split]))
    lines = [
        "| | " + " | ".join(f"{split}: base | {split}: with LoRA" for split in splits) + " |",
        "|---|" + "---|---|" * len(splits),
    ]
    for metric in metrics:
        cells = [f"{before[split][metric]:.0%} | **{after[split][metric]:.0%}**" for split in splits]
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    return lines


def lora_usage_section(repo_id: str, base_model: str, summary: Mapping | None = None) -> str:
    """The `usage` block of a LoRA card: load the base pipeline, then the adapter from `repo_id`, and sample."""
    summary = summary or {}
    prompt = summary.get("sample_prompts", [GENERIC_PROMPT])[0]
    return (
        f"## Use\n\n```python\n{load_base_code(base_model)}\npipe.load_lora_weights({json.dumps(repo_id)})\n"
        f"{sample_line(prompt, summary)}\n```\n\n`pipe.fuse_lora()` merges the adapter into the weights for faster "
        "sampling; `pipe.unload_lora_weights()` restores the base model."
    )


def write_lora_card(
    folder: str | os.PathLike, model, args: Mapping, summary: Mapping, sample_grid: str | os.PathLike | None = None
) -> ModelCard:
    """Write or update a LoRA adapter folder's `README.md`; `model` is the backbone with the adapter."""
    folder = Path(folder)
    family = family_of(model)
    config = model.peft_config[ADAPTER_NAME]
    recorded = summary["base_model"]
    base_model = public_base_model(recorded)
    adapted = adapted_modules(model)
    trainable = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
    data = data_source(args, f"the shapes world's {args['shapes_split']} combinations")
    base = f"`{base_model}`" if hub_id_or_none(recorded) else f"the local folder `{base_model}`"
    if is_shipped_shapes_model(recorded):
        base = "the shapes model that ships with diffusers-lmlp (`pretrained_shapes_pipeline()`)"
    lines = [
        f"# {folder.resolve().name}",
        "",
        f"A LoRA adapter for a **{family.label}** text-to-image backbone ({family.paper}), trained with diffusers-lmlp "
        "(`python -m diffusers_lmlp.train --lora_rank ...`).",
        "",
        "- Base pipeline: " + base,
        f"- LoRA: rank {config.r}, alpha {config.lora_alpha:g}, dropout {config.lora_dropout:g}; {len(adapted)} layers "
        f"adapted ({', '.join(f'`{name}`' for name in names_in_block(adapted))} in the blocks), {trainable:,} "
        "parameters",
        f"- Training: {summary['steps']} steps on {data}, batch {args['train_batch_size']} × "
        f"{args['gradient_accumulation_steps']} accumulation × {summary['num_processes']} process(es), AdamW lr "
        f"{args['learning_rate']}, {summary['train_seconds']} s",
    ]
    if "scores_before" in summary:
        steps, guidance = (summary["evaluation_sampler"][key] for key in ("num_inference_steps", "guidance_scale"))
        lines += ["", "## Scores", "", "The shapes scorer's accuracies (`diffusers_lmlp.evaluation`) of the base model "
                  f"and of the base model with this adapter, on the same captions and seeds ({steps} steps, guidance "
                  f"{guidance}):", "", *score_table(summary)]  # fmt: skip
    if sample_grid is not None:
        lines += ["", f"![samples]({Path(sample_grid).name})"]
    usage = lora_usage_section(args.get("hub_model_id") or folder.resolve().name, base_model, summary)
    blocks = {"description": "\n".join(lines), "usage": usage}
    return save_card(folder, [family.tag, "lora"], blocks, base_model=hub_id_or_none(recorded))
