"""`lateralization`: the L-MLP paper's Fig. 6 (the first-stage weights of chosen layers, left hemisphere, L × L,
above right, D × D, each normalised to [0, 1]) for any UL-MLP or MoE-MLP (each expert on its own: the router mixes
them per sample), with the measures that check its claims."""

import functools
import itertools
import json
from pathlib import Path

from torch import nn

from ..progress import progress_bar
from .figures import format_table, grid_figure, model_label, noise_line, number, write_outputs
from .layers import block_name, check_kind, first_stage, layer_block, num_blocks
from .metrics import NOISE_DRAWS, channel_mixing_measures, mean_abs, noise_band, normalise, token_mixing_measures
from .regions import TokenRegions


FIGURE, WEIGHTS, REPORT = "lateralization.png", "lateralization.safetensors", "lateralization.json"
FILES = (FIGURE, REPORT, WEIGHTS)  # listed after the table


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
    """Measure and draw the first stage of `layers` into `output_dir` (`FILES`); return the report."""
    check_kind(model, "lateralization")
    regions = TokenRegions.from_config(model.config)
    blocks = num_blocks(model.config["num_layers"])
    weights, entries, lefts = {}, [], {}
    with progress_bar(len(layers), "layers", unit="layer", disable=not progress) as bar:
        for layer in layers:
            left, right = (weight.detach().float().cpu().clone() for weight in first_stage(layer_block(model, layer)))
            weights |= {f"layer_{layer}.left": left, f"layer_{layer}.right": right}
            # Each L × L matrix with its names: {} for a UL-MLP's (L, L), head and expert for an MoE-MLP's (H, E, L, L).
            indices = itertools.product(*map(range, left.shape[:-2]))
            lefts[layer] = [(dict(zip(("head", "expert"), index)), left[index]) for index in indices]
            measured = [
                {**names, **token_mixing_measures(matrix, regions), "mean_abs": mean_abs(matrix)}
                for names, matrix in lefts[layer]
            ]
            entries.append(
                {
                    "layer": layer,
                    "block": block_name(layer, blocks),
                    "left": measured if left.ndim == 4 else measured[0],
                    "right": {**channel_mixing_measures(right), "mean_abs": mean_abs(right)},
                }
            )
            bar.update()
    hidden_size, seq_len = weights[f"layer_{layers[0]}.right"].shape[0], regions.seq_len
    report = {
        "model": model_label(model),
        "pipeline": source,
        "regions": regions.to_json(),
        "normalisation": "min-max per matrix: (w - min) / (max - min)",
        "layers": entries,
        "noise": {
            "draws": NOISE_DRAWS,
            "left": noise_band(functools.partial(token_mixing_measures, regions=regions), seq_len),
            "right": noise_band(channel_mixing_measures, hidden_size),
        },
    }
    # The Fig. 6 grid: a column per layer, a row per left-hemisphere matrix, then the right hemisphere.
    rows = [
        list(row) for row in zip(*([(normalise(m).numpy(), regions.boundaries) for _, m in lefts[k]] for k in layers))
    ]
    rows.append([(normalise(weights[f"layer_{layer}.right"]).numpy(), ()) for layer in layers])
    figure = grid_figure(
        f"First-stage weights (L-MLP Fig. 6): {report['model']}, --pipeline {source}",
        [
            regions.describe(),
            "Rows are outputs, columns inputs; each matrix is normalised to [0, 1] on its own.",
            "Red lines: where the text tokens (after the time token) and the image tokens begin.",
        ],
        [f"layer {entry['layer']} ({entry['block']})" for entry in entries],
        [
            *(f"{_label(names)}: tokens {seq_len} × {seq_len}" for names, _ in lefts[layers[0]]),
            f"right: channels {hidden_size} × {hidden_size}",
        ],
        rows,
    )
    metadata = {"pipeline": source, "regions": json.dumps(regions.to_json())}
    write_outputs(output_dir, FILES, figure, weights, metadata, report)
    return report
