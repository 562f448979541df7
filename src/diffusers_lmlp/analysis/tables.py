"""The plain-text tables the analysis commands print."""


def number(value: float | None, digits: int = 3) -> str:
    """A measure for a table: fixed-point, or "–" where it is not defined (`None`)."""
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
