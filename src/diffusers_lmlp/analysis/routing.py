"""`routing`: what decides the token mixing of an input-dependent model, watched while it samples captions.

For an MoE-MLP, the routers' expert probabilities per layer, head and sampler step, with their balance statistics and
the MoE-MLP paper's load-balancing loss. For a U-ViT, the mean attention maps of the chosen layers (what the L-MLP
paper compares Fig. 6 with), drawn and measured as `lateralization` does a left hemisphere.
"""

import contextlib
import functools
import json
from dataclasses import asdict
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import save_file

from ..models.families import family_of
from ..models.mixers.moe import load_balancing_loss
from ..models.mixers.routing import collect_router_probs
from .attention import record_attention
from .figures import grid_figure, heat_map
from .kinds import check_routing, routes
from .layers import block_name, layer_block, num_blocks
from .metrics import NOISE_DRAWS, balance_statistics, noise_band, normalise, token_mixing_measures
from .regions import TokenRegions
from .sampling import SamplerSettings, sample_trajectories
from .tables import format_table, noise_line, number


FIGURE, DATA, REPORT = "routing.png", "routing.safetensors", "routing.json"
# What the command writes into its output folder, as listed after its table.
FILES = (FIGURE, REPORT, DATA)


def record_expert_usage(
    pipeline, layers: list[int], captions: list[str], settings: SamplerSettings, progress: bool = True
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The gate probabilities of the routers of `layers` while an MoE-MLP pipeline samples `captions`: the
    (S, layers, H, E) mean per step, every pass's (layers, P, H, E), and the S timesteps."""
    model = pipeline.transformer
    steps: list[list[list[torch.Tensor]]] = [[[] for _ in layers] for _ in range(settings.num_inference_steps)]
    with contextlib.ExitStack() as stack:
        recorded = [stack.enter_context(collect_router_probs(layer_block(model, layer))) for layer in layers]

        def take(step: int, timestep: int) -> None:
            for index, outputs in enumerate(recorded):
                steps[step][index].append(torch.cat(outputs).double().cpu())  # (passes of this step, H, E)
                outputs.clear()

        timesteps = sample_trajectories(pipeline, captions, settings, take, progress)
    by_step = [[torch.cat(probs) for probs in step] for step in steps]  # S × layers × (passes, H, E)
    usage = torch.stack([torch.stack([probs.mean(0) for probs in step]) for step in by_step])  # (S, layers, H, E)
    passes = torch.stack([torch.cat([step[index] for step in by_step]) for index in range(len(layers))])
    return usage, passes, timesteps  # passes: (layers, P, H, E)


def usage_report(layers: list[int], blocks: int, passes: torch.Tensor) -> dict:
    """The load-balance part of the report from (layers, P, H, E) `passes`: per layer and head, then the loss."""
    entries = [
        {
            "layer": layer,
            "block": block_name(layer, blocks),
            "heads": [{"head": head, **balance_statistics(passes[index, :, head])} for head in range(passes.shape[2])],
        }
        for index, layer in enumerate(layers)
    ]
    return {"layers": entries, "balance_loss": float(load_balancing_loss(passes, weight=1.0))}


def usage_figure(usage: torch.Tensor, report: dict) -> Image.Image:
    """The (S, layers, H, E) `usage` across sampling: a row per layer, a column per head, panels experts × steps."""
    num_steps, _, num_heads, num_experts = usage.shape
    panels = [
        [heat_map(usage[:, index, head, :].T.numpy()) for head in range(num_heads)]  # (E, S) each
        for index in range(usage.shape[1])
    ]
    timesteps = report["timesteps"]
    branches = " and both guidance branches" if report["sampler"]["guidance_scale"] > 1 else ""
    notes = [
        f"Each panel: the mean gate probability of experts e0-e{num_experts - 1} (rows, top down) at each sampler "
        f"step (columns, t = {timesteps[0]} ... {timesteps[-1]}),",
        f"over {len(report['captions'])} captions{branches}. Using the experts evenly is 1/E = {1 / num_experts:.2f}.",
    ]
    return grid_figure(
        f"Expert usage while sampling: {report['model']}, --pipeline {report['pipeline']}",
        notes,
        [f"head {head}" for head in range(num_heads)],
        [f"layer {entry['layer']} ({entry['block']})" for entry in report["layers"]],
        panels,
    )


def attention_figure(maps: list[torch.Tensor], report: dict, regions: TokenRegions) -> Image.Image:
    """The (L, L) mean attention `maps`, a column per layer, drawn as `lateralization` draws a left hemisphere."""
    notes = [
        regions.describe(),
        "Rows are outputs (queries), columns inputs (keys); each map is the mean over heads, captions and sampler",
        "steps, normalised to [0, 1] on its own. Red lines: where the text and the image tokens begin.",
    ]
    return grid_figure(
        f"Attention maps: {report['model']}, --pipeline {report['pipeline']}",
        notes,
        [f"layer {entry['layer']} ({entry['block']})" for entry in report["layers"]],
        [f"attention: tokens {regions.seq_len} × {regions.seq_len}"],
        [[heat_map(normalise(attention).numpy(), regions.boundaries) for attention in maps]],
    )


def expert_usage(
    pipeline, layers: list[int], captions: list[str], settings: SamplerSettings, report: dict, progress: bool
) -> tuple[Image.Image, dict[str, torch.Tensor]]:
    """Record an MoE-MLP's routers and add timesteps and balance statistics to `report`; returns figure and tensors."""
    usage, passes, timesteps = record_expert_usage(pipeline, layers, captions, settings, progress)
    blocks = num_blocks(pipeline.transformer.config["num_layers"])
    report.update(kind="expert usage", timesteps=timesteps, **usage_report(layers, blocks, passes))
    return usage_figure(usage, report), {"usage": usage.float(), "timesteps": torch.tensor(timesteps)}


def attention_maps(
    pipeline, layers: list[int], captions: list[str], settings: SamplerSettings, report: dict, progress: bool
) -> tuple[Image.Image, dict[str, torch.Tensor]]:
    """Record a U-ViT's attention maps and add timesteps, regions, measures and noise bands to `report`; returns the
    figure and tensors."""
    model = pipeline.transformer
    with record_attention([layer_block(model, layer) for layer in layers]) as average:
        timesteps = sample_trajectories(pipeline, captions, settings, progress=progress)
    maps = average.means()  # one (L, L) map per layer
    regions = TokenRegions.from_config(model.config)
    blocks = num_blocks(model.config["num_layers"])
    measures = functools.partial(token_mixing_measures, regions=regions)
    report.update(
        kind="attention",
        timesteps=timesteps,
        regions=regions.to_json(),
        layers=[
            {"layer": layer, "block": block_name(layer, blocks), "attention": measures(attention)}
            for layer, attention in zip(layers, maps)
        ],
        noise={"draws": NOISE_DRAWS, "attention": noise_band(measures, regions.seq_len)},
    )
    tensors = {f"layer_{layer}.attention": attention.float() for layer, attention in zip(layers, maps)}
    return attention_figure(maps, report, regions), tensors


def run_routing(
    pipeline,
    layers: list[int],
    captions: list[str],
    settings: SamplerSettings,
    output_dir: Path,
    source: str,
    progress: bool = True,
) -> dict:
    """Sample `captions`, record the routers (MoE-MLP) or attention (U-ViT) of `layers`, write `FILES` into
    `output_dir` and return the report; `source` is what `--pipeline` named."""
    model = pipeline.transformer
    check_routing(model)
    family = family_of(model)
    report = {
        "model": f"{family.label} ({family.class_name})",
        "pipeline": source,
        "captions": captions,
        "sampler": asdict(settings),
    }
    record = expert_usage if routes(model) else attention_maps
    image, tensors = record(pipeline, layers, captions, settings, report, progress)
    output_dir.mkdir(parents=True, exist_ok=True)
    image.save(output_dir / FIGURE, optimize=True)
    save_file(tensors, output_dir / DATA, metadata={"pipeline": source})
    (output_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def table(report: dict) -> str:
    """The report's figures as a plain-text table: per layer and head for expert usage, per layer for attention."""
    if report["kind"] == "expert usage":
        rows = [("layer", "block", "head", "usage", "top-1 share", "cv", "entropy")]
        for entry in report["layers"]:
            for head in entry["heads"]:
                rows.append(
                    (
                        str(entry["layer"]), entry["block"], str(head["head"]),
                        " ".join(f"{value:.2f}" for value in head["usage"]),
                        " ".join(f"{value:.2f}" for value in head["top1"]),
                        number(head["cv"]), number(head["entropy"]),
                    )
                )  # fmt: skip
        footer = f"\nload-balancing loss (MoE-MLP paper, weight 1): {report['balance_loss']:.4f}"
    else:
        rows = [("layer", "block", "diagonal", "locality", "periodicity")]
        for entry in report["layers"]:
            measures = entry["attention"]
            rows.append((str(entry["layer"]), entry["block"], *(number(measures[key]) for key in rows[0][2:])))
        footer = "\n" + noise_line(report["noise"])
    return format_table(rows, text_columns=5 if report["kind"] == "expert usage" else 2) + footer
