"""`lateralization`: the L-MLP paper's Fig. 6 for any UL-MLP or MoE-MLP, with the measures that check its claims.

Fig. 6 draws the first-stage weights of chosen layers, left hemisphere (FNN_L, token mixing, L × L) above right
(FNN_R, channel mixing, D × D), each normalised to [0, 1]. Each matrix is also measured (`metrics`); an MoE-MLP's
experts are drawn and measured one by one, since the router mixes them per sample.
"""

import functools
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..models.families import family_of
from ..progress import progress_bar
from .figures import format_table, grid_figure, noise_line, number
from .layers import block_name, check_kind, first_stage, layer_block, num_blocks
from .metrics import NOISE_DRAWS, channel_mixing_measures, mean_abs, noise_band, normalise, token_mixing_measures
from .regions import TokenRegions


FIGURE, WEIGHTS, REPORT = "lateralization.png", "lateralization.safetensors", "lateralization.json"
FILES = (FIGURE, REPORT, WEIGHTS)  # listed after the table


def left_matrices(left: torch.Tensor) -> list[tuple[dict[str, int], torch.Tensor]]:
    """Each L × L left-hemisphere matrix with its names: `{}` for a UL-MLP's (L, L), `{"head": h, "expert": e}` for
    an MoE-MLP's (H, E, L, L)."""
    if left.ndim == 2:
        return [({}, left)]
    return [({"head": h, "expert": e}, left[h, e]) for h in range(left.shape[0]) for e in range(left.shape[1])]


def _label(names: dict[str, int]) -> str:
    return " ".join(["left", *(f"{key[0]}{value}" for key, value in names.items())])  # "left h0 e1"


def table(report: dict) -> str:
    """The report's measures as a plain-text table, one row per matrix."""
    rows = [("layer", "block", "hemisphere", "diagonal", "locality", "periodicity", "mean |w|")]
    for entry in report["layers"]:
        layer, lefts, right = str(entry["layer"]), entry["left"], entry["right"]
        for left in lefts if isinstance(lefts, list) else [lefts]:
            names = {key: left[key] for key in ("head", "expert") if key in left}
            measures = [number(left[key]) for key in ("diagonal", "locality", "periodicity")]
            rows.append((layer, entry["block"], _label(names), *measures, number(left["mean_abs"], 4)))
        rows.append(
            (layer, entry["block"], "right", number(right["diagonal"]), "–", "–", number(right["mean_abs"], 4))
        )
    return format_table(rows, text_columns=3) + "\n" + noise_line(report["noise"])


def run_lateralization(
    model: nn.Module, layers: list[int], output_dir: Path, source: str, progress: bool = True
) -> dict:
    """Measure and draw the first stage of `layers`, write `FILES` into `output_dir` and return the report;
    `source` is what `--pipeline` named."""
    check_kind(model, "lateralization")
    regions = TokenRegions.from_config(model.config)
    blocks = num_blocks(model.config["num_layers"])
    weights, entries = {}, []
    for layer in layers:
        left, right = (weight.detach().float().cpu().clone() for weight in first_stage(layer_block(model, layer)))
        weights |= {f"layer_{layer}.left": left, f"layer_{layer}.right": right}
    with progress_bar(len(layers), "layers", unit="layer", disable=not progress) as bar:
        for layer in layers:
            left, right = weights[f"layer_{layer}.left"], weights[f"layer_{layer}.right"]
            lefts = [
                {**names, **token_mixing_measures(matrix, regions), "mean_abs": mean_abs(matrix)}
                for names, matrix in left_matrices(left)
            ]
            right = {**channel_mixing_measures(right), "mean_abs": mean_abs(right)}
            entries.append(
                {
                    "layer": layer,
                    "block": block_name(layer, blocks),
                    "left": lefts if left.ndim == 4 else lefts[0],
                    "right": right,
                }
            )
            bar.update()
    family = family_of(model)
    hidden_size = weights[f"layer_{layers[0]}.right"].shape[0]
    report = {
        "model": f"{family.label} ({family.class_name})",
        "pipeline": source,
        "regions": regions.to_json(),
        "normalisation": "min-max per matrix: (w - min) / (max - min)",
        "layers": entries,
        "noise": {
            "draws": NOISE_DRAWS,
            "left": noise_band(functools.partial(token_mixing_measures, regions=regions), regions.seq_len),
            "right": noise_band(channel_mixing_measures, hidden_size),
        },
    }
    # The Fig. 6 grid: a column per layer, a row per left-hemisphere matrix, then the right hemisphere.
    names = [names for names, _ in left_matrices(weights[f"layer_{layers[0]}.left"])]
    rows = [[] for _ in range(len(names) + 1)]
    for layer in layers:
        for row, (_, matrix) in zip(rows, left_matrices(weights[f"layer_{layer}.left"])):
            row.append((normalise(matrix).numpy(), regions.boundaries))
        rows[-1].append((normalise(weights[f"layer_{layer}.right"]).numpy(), ()))
    seq_len = regions.seq_len
    figure = grid_figure(
        f"First-stage weights (L-MLP Fig. 6): {report['model']}, --pipeline {source}",
        [
            regions.describe(),
            "Rows are outputs, columns inputs; each matrix is normalised to [0, 1] on its own.",
            "Red lines: where the text tokens (after the time token) and the image tokens begin.",
        ],
        [f"layer {entry['layer']} ({entry['block']})" for entry in entries],
        [
            *(f"{_label(n)}: tokens {seq_len} × {seq_len}" for n in names),
            f"right: channels {hidden_size} × {hidden_size}",
        ],
        rows,
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    figure.save(output_dir / FIGURE, optimize=True)
    save_file(weights, output_dir / WEIGHTS, metadata={"pipeline": source, "regions": json.dumps(regions.to_json())})
    (output_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report
