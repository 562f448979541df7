"""`lateralization`: the L-MLP paper's Fig. 6 for any UL-MLP or MoE-MLP, with the measures that check its claims.

Fig. 6 draws the first-stage weights of chosen layers, left hemisphere (FNN_L, token mixing, L × L) above right
(FNN_R, channel mixing, D × D), each normalised to [0, 1] with red lines between the token regions. Here any layers
can be drawn and each matrix is also measured (`metrics`); an MoE-MLP's experts are drawn and measured one by one,
since the router mixes them per sample.
"""

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import save_file
from torch import nn

from ..models.families import family_of
from ..progress import progress_bar
from .figures import grid_figure, heat_map
from .kinds import check_lateralization, first_stage
from .layers import block_name, layer_block, num_blocks
from .metrics import (
    NOISE_DRAWS,
    channel_mixing_measures,
    mean_abs,
    noise_band,
    normalise,
    token_mixing_measures,
)
from .regions import TokenRegions
from .tables import format_table, noise_line, number


FIGURE, WEIGHTS, REPORT = "lateralization.png", "lateralization.safetensors", "lateralization.json"
# What the command writes into its output folder, as listed after its table.
FILES = (FIGURE, REPORT, WEIGHTS)


@dataclass(frozen=True)
class FirstStage:
    """The first-stage weights of one layer, rows = outputs: left (L, L), or (H, E, L, L) for MoE-MLP experts, and
    right (D, D)."""

    layer: int
    block: str
    left: torch.Tensor
    right: torch.Tensor

    def left_matrices(self) -> list[tuple[dict[str, int], torch.Tensor]]:
        """Each L × L left-hemisphere matrix with its names: `{}` for a UL-MLP, `{"head": h, "expert": e}` for an
        MoE-MLP."""
        if self.left.ndim == 2:
            return [({}, self.left)]
        heads, experts = self.left.shape[:2]
        return [({"head": h, "expert": e}, self.left[h, e]) for h in range(heads) for e in range(experts)]


def read_first_stages(model: nn.Module, layers: list[int]) -> list[FirstStage]:
    """The first-stage weights of `layers`, copied to the CPU; `ValueError` for a model without them."""
    check_lateralization(model)
    blocks = num_blocks(model.config["num_layers"])
    stages = []
    for layer in layers:
        left, right = (weight.detach().float().cpu().clone() for weight in first_stage(layer_block(model, layer)))
        stages.append(FirstStage(layer, block_name(layer, blocks), left, right))
    return stages


def measure(stage: FirstStage, regions: TokenRegions) -> dict:
    """The report entry of one layer: its measures (see `metrics`)."""
    left = [
        {**names, **token_mixing_measures(matrix, regions), "mean_abs": mean_abs(matrix)}
        for names, matrix in stage.left_matrices()
    ]
    right = {**channel_mixing_measures(stage.right), "mean_abs": mean_abs(stage.right)}
    return {
        "layer": stage.layer,
        "block": stage.block,
        "left": left if stage.left.ndim == 4 else left[0],
        "right": right,
    }


def _label(names: dict[str, int]) -> str:
    return " ".join(["left", *(f"{key[0]}{value}" for key, value in names.items())])  # "left h0 e1"


def table(report: dict) -> str:
    """The report's measures as a plain-text table, one row per matrix."""
    rows = [("layer", "block", "hemisphere", "diagonal", "locality", "periodicity", "mean |w|")]
    for entry in report["layers"]:
        lefts = entry["left"] if isinstance(entry["left"], list) else [entry["left"]]
        for left in lefts:
            names = {key: left[key] for key in ("head", "expert") if key in left}
            rows.append(
                (
                    str(entry["layer"]), entry["block"], _label(names), number(left["diagonal"]),
                    number(left["locality"]), number(left["periodicity"]), number(left["mean_abs"], 4),
                )
            )  # fmt: skip
        right = entry["right"]
        rows.append(
            (str(entry["layer"]), entry["block"], "right", number(right["diagonal"]), "–", "–",
             number(right["mean_abs"], 4))
        )  # fmt: skip
    return format_table(rows, text_columns=3) + "\n" + noise_line(report["noise"])


def figure(stages: list[FirstStage], regions: TokenRegions, title: str) -> Image.Image:
    """The Fig. 6 grid: a column per layer, a row per left-hemisphere matrix, then the right hemisphere."""
    rows = [[] for _ in range(len(stages[0].left_matrices()) + 1)]
    for stage in stages:
        for row, (_, matrix) in zip(rows, stage.left_matrices()):
            row.append(heat_map(normalise(matrix).numpy(), regions.boundaries))
        rows[-1].append(heat_map(normalise(stage.right).numpy()))
    seq_len, hidden_size = regions.seq_len, stages[0].right.shape[0]
    row_titles = [f"{_label(names)}: tokens {seq_len} × {seq_len}" for names, _ in stages[0].left_matrices()]
    notes = [
        regions.describe(),
        "Rows are outputs, columns inputs; each matrix is normalised to [0, 1] on its own.",
        "Red lines: where the text tokens (after the time token) and the image tokens begin.",
    ]
    return grid_figure(
        title,
        notes,
        [f"layer {stage.layer} ({stage.block})" for stage in stages],
        [*row_titles, f"right: channels {hidden_size} × {hidden_size}"],
        rows,
    )


def run_lateralization(
    model: nn.Module, layers: list[int], output_dir: Path, source: str, progress: bool = True
) -> dict:
    """Measure and draw the first stage of `layers`, write `FILES` into `output_dir` and return the report;
    `source` is what `--pipeline` named."""
    stages = read_first_stages(model, layers)
    regions = TokenRegions.from_config(model.config)
    family = family_of(model)
    entries = []
    with progress_bar(len(stages), "layers", unit="layer", disable=not progress) as bar:
        for stage in stages:
            entries.append(measure(stage, regions))
            bar.update()
    report = {
        "model": f"{family.label} ({family.class_name})",
        "pipeline": source,
        "regions": regions.to_json(),
        "normalisation": "min-max per matrix: (w - min) / (max - min)",
        "layers": entries,
        "noise": {
            "draws": NOISE_DRAWS,
            "left": noise_band(functools.partial(token_mixing_measures, regions=regions), regions.seq_len),
            "right": noise_band(channel_mixing_measures, stages[0].right.shape[0]),
        },
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    title = f"First-stage weights (L-MLP Fig. 6): {report['model']}, --pipeline {source}"
    figure(stages, regions, title).save(output_dir / FIGURE, optimize=True)
    weights = {f"layer_{stage.layer}.{side}": getattr(stage, side) for stage in stages for side in ("left", "right")}
    save_file(weights, output_dir / WEIGHTS, metadata={"pipeline": source, "regions": json.dumps(regions.to_json())})
    (output_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report
