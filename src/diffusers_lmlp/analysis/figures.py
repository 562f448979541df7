"""The analysis' heat maps and the benchmarks' bar charts (matplotlib, the `plots` extra), the plain-text tables the
analysis commands print, and the files they write."""

import io
import json
import textwrap
from pathlib import Path

import numpy as np
from PIL import Image


def model_label(model) -> str:
    from ..models.families import family_of

    family = family_of(model)
    return f"{family.label} ({family.class_name})"


def write_outputs(output_dir: Path, files: tuple[str, str, str], figure, tensors: dict, metadata: dict, report: dict):
    """Write the figure, the report and the tensors under `files`' names (.png, .json, .safetensors)."""
    from safetensors.torch import save_file

    output_dir.mkdir(parents=True, exist_ok=True)
    figure.save(output_dir / files[0], optimize=True)
    (output_dir / files[1]).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    save_file(tensors, output_dir / files[2], metadata=metadata)


def grid_figure(
    title: str,
    notes: list[str],
    column_titles: list[str],
    row_titles: list[str],
    panels: list[list[tuple[np.ndarray, tuple[int, ...]]]],
) -> Image.Image:
    """`panels[row][column]` viridis heat maps in a labelled grid under a title and notes, with a 0-to-1 colour bar.
    A panel is a matrix in [0, 1] and the rows and columns before which a red line is drawn (token regions)."""
    heading = "\n".join([title, *(textwrap.fill(note, 110) for note in notes)])
    rows, columns = len(panels), len(column_titles)
    size = (2.6 * columns + 1.5, 2.6 * rows + 0.2 * heading.count("\n") + 0.6)
    figure = new_figure(figsize=size, layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    image = None
    for row, (row_title, row_panels) in enumerate(zip(row_titles, panels)):
        for column, (values, boundaries) in enumerate(row_panels):
            ax = axes[row][column]
            image = ax.imshow(
                np.asarray(values), cmap="viridis", vmin=0, vmax=1, interpolation="nearest", aspect="auto"
            )
            for boundary in boundaries:
                ax.axhline(boundary - 0.5, color="red", linewidth=0.8)
                ax.axvline(boundary - 0.5, color="red", linewidth=0.8)
            ax.tick_params(labelsize=7)
            if row == 0:
                ax.set_title(column_titles[column], fontsize=9)
            if column == 0:
                ax.set_ylabel(row_title, fontsize=8)
    figure.suptitle(heading, fontsize=9, x=0.01, horizontalalignment="left")
    figure.colorbar(image, ax=axes, fraction=0.02, pad=0.01)
    return as_image(figure)


def new_figure(**kwargs):
    """A matplotlib `Figure`, made without pyplot (no global state changes); `SystemExit` saying how to install it."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise SystemExit("error: the figures need matplotlib: pip install 'diffusers-lmlp[plots]'") from None
    return Figure(**kwargs)


def as_image(figure) -> Image.Image:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def bar_chart(
    title: str, labels: list[str], panels: list[tuple[str, dict[str, list[float | None]], str]], reference=None
) -> Image.Image:
    """Horizontal bars, a row per label: one panel per (x label, {series: a value per label, None for none}, value
    format), each bar labelled with its value; `reference` draws a line at that x in the first panel."""
    height = 0.6 + 0.22 * len(labels) * max(len(series) for _, series, _ in panels)
    figure = new_figure(figsize=(5 * len(panels) + 2, height + 0.8), layout="constrained")
    import matplotlib  # after new_figure, which says how to install it

    axes = figure.subplots(1, len(panels), squeeze=False, sharey=True)
    positions, colours = np.arange(len(labels)), iter(matplotlib.rcParams["axes.prop_cycle"].by_key()["color"])
    for ax, (xlabel, series, value_format) in zip(axes[0], panels):
        width = 0.8 / len(series)
        for k, (name, values) in enumerate(series.items()):
            offsets = positions - 0.4 + width * (k + 0.5)
            drawn = [(y, v) for y, v in zip(offsets, values) if v is not None]
            bars = ax.barh(
                [y for y, _ in drawn], [v for _, v in drawn], height=width * 0.9, label=name, color=next(colours)
            )
            ax.bar_label(bars, [format(v, value_format) for _, v in drawn], fontsize=7, padding=2)
        ax.set_xlabel(xlabel, fontsize=9)
        ax.margins(x=0.15)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=7)
    if reference is not None:
        axes[0][0].axvline(reference, color="black", linewidth=0.8)
    axes[0][0].set_yticks(positions, labels, fontsize=8)
    axes[0][0].invert_yaxis()
    figure.suptitle(title, fontsize=9, x=0.01, horizontalalignment="left")
    return as_image(figure)


def number(value: float | None, digits: int = 3) -> str:
    """A measure for a table: fixed-point, or "–" where undefined (`None`)."""
    return "–" if value is None else f"{value:.{digits}f}"


def format_table(rows: list[tuple[str, ...]], text_columns: int) -> str:
    """Rows of cells (header first) as aligned columns: the first `text_columns` left-aligned, the rest right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(width) if i < text_columns else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    )


def noise_line(noise: dict) -> str:
    """A report's noise bands (`{"draws": n, <what>: {measure: [low, high]}}`, `metrics.noise_band`) in one line."""
    parts = [
        f"{what}: " + ", ".join(f"{name} {number(low)} to {number(high)}" for name, (low, high) in bands.items())
        for what, bands in noise.items()
        if what != "draws"
    ]
    return f"i.i.d. Gaussian matrices of the same size, 95% of {noise['draws']} draws: " + "; ".join(parts)
