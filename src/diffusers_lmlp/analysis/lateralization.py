"""`lateralization`: the L-MLP paper's Fig. 6 for any UL-MLP or MoE-MLP, with the measures that check its claims.

Fig. 6 draws the first-stage linear weights of layers 1, 5, 9, 13 and 17: the left hemisphere (FNN_L, token
mixing, L × L) in one row and the right hemisphere (FNN_R, channel mixing, D × D) in the other, each matrix normalised
to [0, 1], with red lines between the token regions. Here the layers are any (`layers.default_layers` adapts the
paper's to the depth), the region lines come from the config (`TokenRegions`), and each matrix is measured
(`metrics`). An MoE-MLP's left hemisphere is E expert matrices per head, which the router mixes per sample: each
expert of each head is drawn and measured on its own, beside the block's one right hemisphere.

The command writes into its output folder:

- `lateralization.png`: the figure, a column per layer, a row per left-hemisphere matrix and one for the right;
- `lateralization.safetensors`: the raw weights, `layer_<k>.left` ((L, L), or (H, E, L, L) for an MoE-MLP) and
  `layer_<k>.right` ((D, D));
- `lateralization.json`: the model, the token regions, `"layers"`, one entry per layer with `"layer"`, `"block"`,
  `"left"` (`diagonal`, `locality`, `periodicity`, `mean_abs`; for an MoE-MLP a list of these, one per head and
  expert, each with its `"head"` and `"expert"`) and `"right"` (`diagonal`, `mean_abs`), and `"noise"`: where the
  measures of structureless matrices of the same sizes fall (`metrics.noise_band`).
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
    """The first-stage weights of one layer (rows = outputs, columns = inputs).

    Args:
        layer (`int`): The layer number, as the reference figure script counts.
        block (`str`): Its module in the stack (`in_blocks.4`, `mid_block`, ...).
        left (`torch.Tensor`): (L, L) token-mixing weight, or (H, E, L, L) for the experts of an MoE-MLP.
        right (`torch.Tensor`): (D, D) channel-mixing weight.
    """

    layer: int
    block: str
    left: torch.Tensor
    right: torch.Tensor

    def left_matrices(self) -> list[tuple[dict[str, int], torch.Tensor]]:
        """Each L × L matrix of the left hemisphere with what names it: `{}` for a UL-MLP, `{"head": h, "expert": e}`
        for each expert of an MoE-MLP."""
        if self.left.ndim == 2:
            return [({}, self.left)]
        heads, experts = self.left.shape[:2]
        return [({"head": h, "expert": e}, self.left[h, e]) for h in range(heads) for e in range(experts)]


def read_first_stages(model: nn.Module, layers: list[int]) -> list[FirstStage]:
    """The first-stage weights of `layers`, copied to the CPU.

    Args:
        model (`nn.Module`): A UL-MLP or MoE-MLP backbone.
        layers (`list[int]`): Layer numbers, checked by `layers.check_layers`.

    Raises:
        `ValueError`: For a model without L-MLP first stages; the message names the subcommand that fits it.
    """
    check_lateralization(model)
    blocks = num_blocks(model.config["num_layers"])
    stages = []
    for layer in layers:
        left, right = (weight.detach().float().cpu().clone() for weight in first_stage(layer_block(model, layer)))
        stages.append(FirstStage(layer, block_name(layer, blocks), left, right))
    return stages


def measure(stage: FirstStage, regions: TokenRegions) -> dict:
    """The report entry of one layer: its measures (see `metrics`).

    Args:
        stage (`FirstStage`): The layer's weights.
        regions (`TokenRegions`): The model's token layout.
    """
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
    """The Fig. 6 grid: a column per layer, a row per left-hemisphere matrix, then the right hemisphere.

    Args:
        stages (`list[FirstStage]`): The layers' weights.
        regions (`TokenRegions`): The token layout (the red lines).
        title (`str`): The figure's first line.
    """
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
    """Measure and draw the first stage of `layers`, and write the command's three files into `output_dir`.

    Args:
        model (`nn.Module`): A UL-MLP or MoE-MLP backbone.
        layers (`list[int]`): Layer numbers, checked by `layers.check_layers`.
        output_dir (`Path`): Where the files go (created if needed).
        source (`str`): What `--pipeline` named, for the report and the figure.
        progress (`bool`, *optional*, defaults to `True`): Show a progress bar over the layers.

    Returns:
        `dict`: The report written to `lateralization.json`.

    Raises:
        `ValueError`: For a model without L-MLP first stages; the message names the subcommand that fits it.
    """
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
