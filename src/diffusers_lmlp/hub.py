"""Model cards for saved pipelines, so a folder is ready for the Hub."""

import os
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData


def write_model_card(
    folder: str | os.PathLike,
    pipe,
    args: dict | None = None,
    summary: dict | None = None,
    sample_grid: str | os.PathLike | None = None,
) -> ModelCard:
    """Write `README.md` (YAML metadata + a description) into a saved `LMLPPipeline` folder.

    Args:
        folder (`str` or `os.PathLike`): The folder `pipe.save_pretrained` wrote.
        pipe (`LMLPPipeline`): The saved pipeline (its backbone config goes into the card).
        args (`dict`, *optional*): The training arguments (recipe, dataset, base model).
        summary (`dict`, *optional*): Training results (steps, time, scores) to report.
        sample_grid (`str` or `os.PathLike`, *optional*): A sample grid inside `folder` to show.

    Returns:
        `ModelCard`: The card, also saved as `<folder>/README.md`.
    """
    args, summary = args or {}, summary or {}
    backbone = pipe.transformer
    config = backbone.config
    kind = "MoE-MLP" if "num_experts" in config else "UL-MLP (L-MLP)"
    num_params = sum(p.numel() for p in backbone.parameters())
    data = ModelCardData(
        library_name="diffusers",
        pipeline_tag="text-to-image",
        license="apache-2.0",
        tags=[
            "text-to-image",
            "diffusers",
            "diffusers-lmlp",
            "mlp",
            "moe-mlp" if "num_experts" in config else "l-mlp",
        ],
        datasets=[args["dataset_name"]] if args.get("dataset_name") else None,
        base_model=args.get("pretrained_model_name_or_path"),
    )
    lines = [
        f"# {Path(folder).resolve().name}",
        "",
        f"A text-to-image latent diffusion model with a **{kind}** backbone ({num_params:,} parameters), trained "
        "with diffusers-lmlp (`examples/train_text_to_image.py`).",
        "",
        f"- Backbone: `{type(backbone).__name__}`, hidden size {config.hidden_size}, {config.num_layers} layers "
        f"(+1 mid block), patch {config.patch_size}, {config.sample_size}×{config.sample_size} latents, "
        f"{backbone.seq_len} tokens"
        + (f", {config.num_experts} experts × {config.num_heads} heads" if "num_experts" in config else ""),
        f"- Native resolution: {pipe.native_size}×{pipe.native_size} px; latent scale "
        f"{pipe.vae.config.scaling_factor:.5f}",
    ]
    if args:
        data_source = args.get("dataset_name") or args.get("train_data_dir") or "the procedural shapes world"
        lines.append(
            f"- Training: {summary.get('steps', args.get('max_train_steps'))} steps on {data_source}, batch "
            f"{args.get('train_batch_size')} × {args.get('gradient_accumulation_steps', 1)} accumulation × "
            f"{summary.get('num_processes', 1)} process(es), AdamW lr {args.get('learning_rate')}, "
            f"EMA {args.get('ema_decay') if args.get('use_ema') else 'off'}, caption dropout {args.get('caption_dropout')}"
        )
    for split, scores in summary.get("scores", {}).items():
        shown = ", ".join(f"{k} {v:.0%}" for k, v in scores.items())
        lines.append(f"- Shapes scorer on {split} captions: {shown}")
    if sample_grid is not None:
        lines += ["", f"![samples]({Path(sample_grid).name})"]
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "import diffusers_lmlp  # registers the pipeline and backbones with diffusers",
        "from diffusers_lmlp import LMLPPipeline",
        "",
        f'pipe = LMLPPipeline.from_pretrained("{args.get("hub_model_id") or Path(folder).resolve().name}")',
        'image = pipe("a prompt", guidance_scale=2.0).images[0]',
        "```",
        "",
        "`guidance_scale` follows diffusers (the papers' scale s is guidance_scale - 1).",
    ]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")
    card.save(os.path.join(folder, "README.md"))
    return card
