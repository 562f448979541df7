"""`routing`: while the pipeline samples captions, forward hooks record an MoE-MLP's expert probabilities per layer,
head and step (with balance statistics and the MoE-MLP paper's load-balancing loss), or a U-ViT's mean attention maps
(what the L-MLP paper compares Fig. 6 with), measured as `lateralization` measures a left hemisphere."""

import contextlib
import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..models.mixers.attention import UViTAttention
from ..models.mixers.moe import collect_router_probs, load_balancing_loss
from ..progress import progress_bar
from .figures import format_table, grid_figure, model_label, noise_line, number, write_outputs
from .layers import block_name, check_kind, layer_block, num_blocks, routes
from .metrics import NOISE_DRAWS, balance_statistics, noise_band, normalise, token_mixing_measures
from .regions import TokenRegions


FIGURE, DATA, REPORT = "routing.png", "routing.safetensors", "routing.json"
FILES = (FIGURE, REPORT, DATA)  # listed after the table


@dataclass(frozen=True)
class SamplerSettings:
    """How the captions are sampled; caption i starts from the noise of seed `seed + i`."""

    num_inference_steps: int
    guidance_scale: float
    seed: int
    batch_size: int


def sample_trajectories(
    pipeline,
    captions: list[str],
    settings: SamplerSettings,
    on_step: Callable[[int, int], None] | None = None,
    progress: bool = True,
) -> list[int]:
    """Sample every caption without decoding, calling `on_step(step, timestep)` after each step; return timesteps."""
    batch_size, num_inference_steps = settings.batch_size, settings.num_inference_steps
    timesteps: list[int] = []
    pipeline.set_progress_bar_config(disable=True)
    num_batches = -(-len(captions) // batch_size)
    with progress_bar(num_batches * num_inference_steps, "sampling", unit="step", disable=not progress) as bar:

        def after_step(pipe, step: int, timestep: torch.Tensor, tensors: dict) -> dict:
            if on_step is not None:
                on_step(step, int(timestep))
            if len(timesteps) < num_inference_steps:
                timesteps.append(int(timestep))
            bar.update()
            return {}

        for first in range(0, len(captions), batch_size):
            batch = captions[first : first + batch_size]
            pipeline(
                batch,
                num_inference_steps=num_inference_steps,
                guidance_scale=settings.guidance_scale,
                generator=[torch.Generator().manual_seed(settings.seed + first + i) for i in range(len(batch))],
                output_type="latent",
                callback_on_step_end=after_step,
            )
    return timesteps


def attention_probabilities(attention: UViTAttention, tokens: torch.Tensor) -> torch.Tensor:
    """The (B, H, L, L) float32 attention probabilities of a `UViTAttention` on its (B, L, D) input, by its `qkv`."""
    batch_size, seq_len, _ = tokens.shape
    qkv = attention.qkv(tokens).reshape(batch_size, seq_len, 3, attention.num_heads, -1)  # (B, L, 3, H, D/H)
    query, key, _ = qkv.float().permute(2, 0, 3, 1, 4).unbind(0)  # 2 × (B, H, L, D/H)
    return (query @ key.transpose(-2, -1) * query.shape[-1] ** -0.5).softmax(-1)  # SDPA's default scale


def expert_usage(pipeline, layers, captions, settings, report: dict, progress: bool):
    """Record the routers of an MoE-MLP's `layers` and their balance into `report`; return the figure and tensors."""
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
    passes = torch.stack([torch.cat([step[i] for step in by_step]) for i in range(len(layers))])  # (l, P, H, E)
    blocks = num_blocks(model.config["num_layers"])
    heads = range(passes.shape[2])
    entries = [
        {"layer": layer, "block": block_name(layer, blocks), "heads": [
            {"head": head, **balance_statistics(passes[index, :, head])} for head in heads
        ]}
        for index, layer in enumerate(layers)
    ]  # fmt: skip
    balance_loss = float(load_balancing_loss(passes, weight=1.0))
    report.update(kind="expert usage", timesteps=timesteps, layers=entries, balance_loss=balance_loss)
    num_experts = usage.shape[3]
    branches = " and both guidance branches" if settings.guidance_scale > 1 else ""
    figure = grid_figure(
        f"Expert usage while sampling: {report['model']}, --pipeline {report['pipeline']}",
        [
            f"Each panel: the mean gate probability of experts e0-e{num_experts - 1} (rows, top down) at each sampler "
            f"step (columns, t = {timesteps[0]} ... {timesteps[-1]}),",
            f"over {len(captions)} captions{branches}. Using the experts evenly is 1/E = {1 / num_experts:.2f}.",
        ],
        [f"head {head}" for head in heads],
        [f"layer {entry['layer']} ({entry['block']})" for entry in entries],
        [[(usage[:, index, head, :].T.numpy(), ()) for head in heads] for index in range(len(layers))],  # (E, S) each
    )
    return figure, {"usage": usage.float(), "timesteps": torch.tensor(timesteps)}


def attention_maps(pipeline, layers, captions, settings, report: dict, progress: bool):
    """Record a U-ViT's mean attention maps (over heads, captions, steps) and their measures into `report`; return
    the figure and tensors."""
    model = pipeline.transformer
    sums, counts, handles = [0.0] * len(layers), [0] * len(layers), []

    def record(index: int, module: UViTAttention, args: tuple, output: torch.Tensor) -> None:
        maps = attention_probabilities(module, args[0]).mean(1)  # (B, L, L), over heads
        sums[index] = sums[index] + maps.double().sum(0).cpu()
        counts[index] += maps.shape[0]

    for index, layer in enumerate(layers):
        (attention,) = [m for m in layer_block(model, layer).modules() if isinstance(m, UViTAttention)]
        handles.append(attention.register_forward_hook(functools.partial(record, index)))
    try:
        timesteps = sample_trajectories(pipeline, captions, settings, progress=progress)
    finally:
        for handle in handles:
            handle.remove()
    maps = [total / count for total, count in zip(sums, counts)]  # one (L, L) map per layer
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
    figure = grid_figure(
        f"Attention maps: {report['model']}, --pipeline {report['pipeline']}",
        [
            regions.describe(),
            "Rows are outputs (queries), columns inputs (keys); each map is the mean over heads, captions and sampler",
            "steps, normalised to [0, 1] on its own. Red lines: where the text and the image tokens begin.",
        ],
        [f"layer {entry['layer']} ({entry['block']})" for entry in report["layers"]],
        [f"attention: tokens {regions.seq_len} × {regions.seq_len}"],
        [[(normalise(attention).numpy(), regions.boundaries) for attention in maps]],
    )
    return figure, {f"layer_{layer}.attention": attention.float() for layer, attention in zip(layers, maps)}


def run_routing(pipeline, layers, captions, settings: SamplerSettings, output_dir: Path, source: str, progress=True):
    """Sample `captions`, record the routers (MoE-MLP) or attention (U-ViT) of `layers`, write `FILES` into
    `output_dir` and return the report; `source` is what `--pipeline` named."""
    model = pipeline.transformer
    check_kind(model, "routing")
    report = {"model": model_label(model), "pipeline": source, "captions": captions, "sampler": asdict(settings)}
    record = expert_usage if routes(model) else attention_maps
    figure, tensors = record(pipeline, layers, captions, settings, report, progress)
    write_outputs(output_dir, FILES, figure, tensors, {"pipeline": source}, report)
    return report


def table(report: dict) -> str:
    """The report's figures as a plain-text table: per layer and head for expert usage, per layer for attention."""
    if report["kind"] == "expert usage":
        rows = [("layer", "block", "head", "usage", "top-1 share", "cv", "entropy")]
        for entry in report["layers"]:
            for head in entry["heads"]:
                usage, top1 = (" ".join(f"{value:.2f}" for value in head[key]) for key in ("usage", "top1"))
                cells = (str(entry["layer"]), entry["block"], str(head["head"]), usage, top1)
                rows.append((*cells, number(head["cv"]), number(head["entropy"])))
        footer = f"\nload-balancing loss (MoE-MLP paper, weight 1): {report['balance_loss']:.4f}"
        return format_table(rows, text_columns=5) + footer
    rows = [("layer", "block", "diagonal", "locality", "periodicity")]
    for entry in report["layers"]:
        rows.append((str(entry["layer"]), entry["block"], *(number(entry["attention"][key]) for key in rows[0][2:])))
    return format_table(rows, text_columns=2) + "\n" + noise_line(report["noise"])
