"""Model cards (`huggingface_hub.ModelCard`): we own a few metadata keys and two marked blocks, `description` (written
at training time) and `usage` (on every push); the rest of a card is the user's and is kept."""

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..models.families import family_of
from ..pipelines.vocabulary import describe_vocabulary, known_words, unknown_words
from ..worlds import WORLDS


DEFAULT_LICENSE = "apache-2.0"
BASE_TAGS = ("text-to-image", "diffusers", "diffusers-lmlp", "mlp")
GENERIC_PROMPT = "a photograph of an astronaut riding a horse"
# The scores' sampler settings (`summary["evaluation_sampler"]`) that are `LMLPPipeline.__call__` arguments.
SAMPLER_CALL_ARGUMENTS = ("num_inference_steps", "guidance_scale")
POOLED_TEXT_PROJECTION = (
    "; the text encoder's last-position state is also projected and added to every image token "
    "(`pooled_text_projection`, not in the papers)"
)


def block_markers(name: str) -> tuple[str, str]:
    begin = f"<!-- begin diffusers-lmlp:{name} (generated: edits inside this block are replaced) -->"
    return begin, f"<!-- end diffusers-lmlp:{name} -->"


def _block_pattern(name: str) -> re.Pattern:
    return re.compile(rf"<!-- begin diffusers-lmlp:{name}\b[^>]*-->.*?{re.escape(block_markers(name)[1])}", re.DOTALL)


def without_block(text: str, name: str) -> str:
    return _block_pattern(name).sub("", text)


def hub_id_or_none(value: str | os.PathLike | None) -> str | None:
    """`value` if it names a Hub repo (a valid repo id that is not a local path), else None."""
    if value is None or os.path.exists(value):
        return None
    try:
        validate_repo_id(str(value))
    except HFValidationError:
        return None
    return str(value)


def data_source(args: Mapping, default: str) -> str:
    """What the model was trained on: a Hub dataset by its id, a local folder by its name only, else `default`."""
    source = args.get("dataset_name") or args.get("train_data_dir")
    if not source:
        return default
    return hub_id_or_none(source) or f"the local folder `{Path(source).name}`"


def write_model_card(
    folder: str | os.PathLike,
    pipe,
    args: Mapping | None = None,
    summary: Mapping | None = None,
    sample_grid: str | os.PathLike | None = None,
) -> ModelCard:
    """Write or update `README.md` (metadata, description, usage; the user's text kept) in the folder
    `pipe.save_pretrained` wrote, from the training `args` and `summary`; return the card."""
    args, name = args or {}, Path(folder).resolve().name
    base_model = hub_id_or_none(args.get("pretrained_model_name_or_path"))
    dataset = hub_id_or_none(args.get("dataset_name"))
    blocks = {
        "description": describe_pipeline(pipe, name, args, summary, sample_grid, base_model),
        "usage": usage_section(args.get("hub_model_id") or name, summary=summary, tokenizer=pipe.tokenizer),
    }
    tags = [family_of(pipe.transformer).tag]
    return save_card(Path(folder), tags, blocks, base_model=base_model, datasets=[dataset] if dataset else None)


def save_card(folder: Path, tags: Sequence[str], blocks: Mapping[str, str], **metadata) -> ModelCard:
    """`update_card` on `folder`'s `README.md` (if any), saved there."""
    path = folder / "README.md"
    card = update_card(path.read_text(encoding="utf-8") if path.is_file() else None, tags, blocks, **metadata)
    card.save(path)
    return card


def update_card(
    existing: str | None,
    tags: Sequence[str],
    blocks: Mapping[str, str],
    license: str | None = None,
    datasets: list[str] | None = None,
    base_model: str | None = None,
) -> ModelCard:
    """The `existing` card (None: a new one) with our metadata, `tags` and `blocks` (replaced, else appended)."""
    card = ModelCard(existing) if existing else None
    data = card.data if card is not None else ModelCardData()
    data.library_name = "diffusers"
    data.pipeline_tag = "text-to-image"
    data.tags = list(dict.fromkeys([*(data.tags or []), *BASE_TAGS, *tags]))
    data.license = license or data.license or DEFAULT_LICENSE
    data.datasets, data.base_model = datasets or data.datasets, base_model or data.base_model
    body = card.text.strip("\n") if card is not None else ""
    for name, content in blocks.items():
        begin, end = block_markers(name)
        block = f"{begin}\n{content.strip()}\n{end}"
        if (pattern := _block_pattern(name)).search(body):
            body = pattern.sub(lambda _: block, body, count=1)
        else:
            body = f"{body}\n\n{block}".lstrip("\n")
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n")


def describe_pipeline(
    pipe,
    title: str,
    args: Mapping | None = None,
    summary: Mapping | None = None,
    sample_grid: str | os.PathLike | None = None,
    base_model: str | None = None,
) -> str:
    """The `description` block: the backbone, its size, its closed vocabulary, its training and scores."""
    args, summary = args or {}, summary or {}
    backbone = pipe.transformer
    config = backbone.config
    family = family_of(backbone)
    num_params = sum(p.numel() for p in backbone.parameters())
    pooled = POOLED_TEXT_PROJECTION if config.get("pooled_text_projection") else ""
    trained = "learning_rate" in args or "steps" in summary
    origin = "trained with diffusers-lmlp (`python -m diffusers_lmlp.train`)" if trained else "for diffusers-lmlp"
    lines = [
        f"# {title}",
        "",
        f"A text-to-image latent diffusion model with a **{family.label}** backbone ({family.paper}; "
        f"{num_params:,} parameters), {origin}.",
        "",
        f"- Backbone: `{type(backbone).__name__}`, hidden size {config.hidden_size}, {config.num_layers} layers "
        f"(+1 mid block), patch {config.patch_size}, {config.sample_size}×{config.sample_size} latents, "
        f"{backbone.seq_len} tokens{family.details(config)}{pooled}",
        f"- Native resolution: {pipe.native_size}×{pipe.native_size} px; latent scale "
        f"{pipe.vae.config.scaling_factor:.5f}",
    ]
    vocabulary = describe_vocabulary(pipe.tokenizer)
    if vocabulary is not None:
        lines.append(
            f"- Vocabulary: closed, {vocabulary}. The tokenizer spells any other word byte by byte, into tokens the "
            "model was not trained on, and the pipeline warns about such words"
        )
    if base_model:
        lines.append(f"- Fine-tuned from [{base_model}](https://huggingface.co/{base_model})")
    if "learning_rate" in args:
        data = data_source(args, WORLDS[args.get("world") or "shapes"].description)
        schedule = f" ({args['lr_scheduler']} schedule)" if "lr_scheduler" in args else ""
        decay = f", weight decay {args['adam_weight_decay']}" if "adam_weight_decay" in args else ""
        snr = f", Min-SNR γ {args['snr_gamma']}" if args.get("snr_gamma") else ""
        lines.append(
            f"- Training: {summary.get('steps', args.get('max_train_steps'))} steps on {data}, batch "
            f"{args.get('train_batch_size')} × {args.get('gradient_accumulation_steps', 1)} accumulation × "
            f"{summary.get('num_processes', 1)} process(es), AdamW lr {args['learning_rate']}{schedule}{decay}{snr}, "
            f"EMA {args.get('ema_decay') if args.get('use_ema') else 'off'}, caption dropout {args.get('caption_dropout')}"
        )
    elif "steps" in summary:
        lines.append(
            f"- Training: {summary['steps']} steps on {summary.get('num_processes', 1)} process(es)"
            + (f", {summary['train_seconds']} s" if "train_seconds" in summary else "")
        )
    world = summary.get("world", "shapes")
    digits = WORLDS[world].fid_digits
    for split, scores in summary.get("scores", {}).items():
        shown = ", ".join(f"{k} {v:.0%}" for k, v in scores.items())
        lines.append(f"- {world.capitalize()} scorer on {split} captions: {shown}")
    for split, fid in summary.get(f"{world}_fid", {}).items():
        lines.append(
            f"- {world.capitalize()}-FID on {split} captions: {fid['fid']:.{digits}f} over {fid['num_images']} images "
            f"(real images against real images: {fid['fid_floor']:.{digits}f})"
        )
    for split, score in summary.get("clip_score", {}).items():
        lines.append(f"- CLIP score on {split} captions: {score:.1f} (the world's CLIP, 100 · cosine)")
    if "evaluation_sampler" in summary:
        settings = ", ".join(f"`{key}={value}`" for key, value in summary["evaluation_sampler"].items())
        lines.append(f"- Scores measured (`diffusers_lmlp.evaluation`) with the sampler settings {settings}")
    if sample_grid is not None:
        lines += ["", f"![samples]({Path(sample_grid).name})"]
    return "\n".join(lines)


def example_prompt(summary: Mapping, tokenizer=None) -> str:
    """The first sample-grid caption, else `GENERIC_PROMPT`, else (a closed vocabulary lacks its words) a shapes one."""
    candidates = [*summary.get("sample_prompts", []), GENERIC_PROMPT]
    if tokenizer is None or known_words(tokenizer) is None:
        return candidates[0]
    from ..shapes.world import train_specs

    candidates.append(train_specs()[0].caption)
    return next((prompt for prompt in candidates if not unknown_words(tokenizer, prompt)), candidates[0])


def sample_line(prompt: str, summary: Mapping) -> str:
    """The snippet's line that samples `prompt` with the scores' sampler settings."""
    sampler = summary.get("evaluation_sampler", {})
    settings = "".join(f", {key}={sampler[key]!r}" for key in SAMPLER_CALL_ARGUMENTS if key in sampler)
    return f"image = pipe({json.dumps(prompt, ensure_ascii=False)}{settings}).images[0]"


def usage_section(
    repo_id: str, summary: Mapping | None = None, code_files: Sequence[str] | None = None, tokenizer=None
) -> str:
    """The `usage` block: load from `repo_id` and sample `example_prompt` with the scores' sampler settings; with
    `code_files` (`--with-code`) through `trust_remote_code=True`, naming the files it runs."""
    summary = summary or {}
    sample = sample_line(example_prompt(summary, tokenizer), summary)
    settings = any(key in summary.get("evaluation_sampler", {}) for key in SAMPLER_CALL_ARGUMENTS)
    guidance = (
        "These are the settings the scores were measured with. " if settings else ""
    ) + "`guidance_scale` follows diffusers (the papers' scale s is guidance_scale - 1)."
    if code_files:
        files = " and ".join(f"`{path}`" for path in code_files)
        intro = (
            "This repo holds the code of its pipeline and backbone, generated from the `diffusers-lmlp` package, so "
            "diffusers loads it with only diffusers, transformers and torch installed:"
        )
        code = "from diffusers import DiffusionPipeline\n\n"
        code += f'pipe = DiffusionPipeline.from_pretrained("{repo_id}", trust_remote_code=True)'
        note = (
            f"`trust_remote_code=True` downloads this repo's {files} and executes them on your machine when the "
            "pipeline loads: read them first, and pin the commit you read with `revision=`. With `diffusers-lmlp` "
            f'installed, `LMLPPipeline.from_pretrained("{repo_id}")` loads the same weights with the installed '
            "code and executes none of the repo's. " + guidance
        )
    else:
        intro = "With the `diffusers-lmlp` package installed:"
        code = "import diffusers_lmlp  # registers the pipeline and backbones with diffusers\n"
        code += f'from diffusers_lmlp import LMLPPipeline\n\npipe = LMLPPipeline.from_pretrained("{repo_id}")'
        note = guidance + (
            " Load Hub repos with `LMLPPipeline.from_pretrained`: diffusers' `DiffusionPipeline.from_pretrained` "
            "refuses third-party component libraries for Hub ids."
        )
    return f"## Use\n\n{intro}\n\n```python\n{code}\n{sample}\n```\n\n{note}"
