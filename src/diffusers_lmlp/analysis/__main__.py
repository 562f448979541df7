"""`python -m diffusers_lmlp.analysis` (or `diffusers-lmlp-analysis`): look inside a model. Parsing needs only light
modules: torch, diffusers and the models are imported in `main`."""

import argparse
import sys
from pathlib import Path

from .. import commands
from ..sampling import GUIDANCE_SCALE


CONSOLE_SCRIPT = "diffusers-lmlp-analysis"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=commands.program_name(CONSOLE_SCRIPT, "diffusers_lmlp.analysis"),
        description="Look inside a trained backbone: the L-MLP paper's Fig. 6 lateralization maps, MoE-MLP expert usage "
        "or U-ViT attention maps, each with the numbers that check the papers' claims.",
    )
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="{lateralization,routing}")
    lateralization = subcommands.add_parser(
        "lateralization",
        help="draw and measure the first-stage weights of a UL-MLP or MoE-MLP (the paper's Fig. 6)",
        description="Draw the first-stage weights of chosen layers, left hemisphere (token mixing, L x L; each expert "
        "and head of an MoE-MLP) and right (channel mixing, D x D), with their diagonal ratio, locality and "
        "periodicity. Writes lateralization.png, .json and .safetensors (the raw weights) into --output_dir.",
    )
    routing = subcommands.add_parser(
        "routing",
        help="MoE-MLP expert usage across sampling, or U-ViT attention maps",
        description="Sample the captions and record an MoE-MLP's expert usage per layer, head and step, with its load "
        "balance, or a U-ViT's mean attention maps of the chosen layers, measured as lateralization measures a left "
        "hemisphere. Writes routing.png, .json and .safetensors into --output_dir.",
    )
    for subcommand in (lateralization, routing):
        subcommand.add_argument(
            "--pipeline", default="shapes",
            help="a pipeline folder, a backbone folder (lateralization only), a Hub id of either, or shapes or emoji "
            "(shipped; default: shapes)",
        )  # fmt: skip
        subcommand.add_argument("--output_dir", type=Path, default=Path("analysis"), help="where the files go")
        subcommand.add_argument("--no_progress", action="store_true", help="no progress bar")
    lateralization.add_argument(
        "--layers", type=commands.number(int, 1), nargs="+",
        help="layer numbers as the reference figure script counts (in, mid, out blocks, from 1; default: the "
        "paper's 1, 5, 9, 13, 17 adapted to the depth)",
    )  # fmt: skip
    routing.add_argument(
        "--layers", type=commands.number(int, 1), nargs="+",
        help="layer numbers, as lateralization counts them (default: every layer of an MoE-MLP, lateralization's "
        "for a U-ViT)",
    )  # fmt: skip
    routing.add_argument("--captions", nargs="+", required=True, help="the captions to sample")
    routing.add_argument(
        "--num_inference_steps", type=commands.number(int, 1), default=20, help="sampler steps per caption"
    )
    routing.add_argument(
        "--guidance_scale", type=float, default=GUIDANCE_SCALE, help="diffusers' g; the papers' s = g - 1"
    )
    routing.add_argument("--seed", type=int, default=0, help="caption i starts from the noise of seed SEED + i")
    routing.add_argument("--batch_size", type=commands.number(int, 1), default=8, help="captions per pipeline call")
    return parser


def run(args: argparse.Namespace) -> tuple[str, list[Path]]:
    """Run the subcommand; its table and the files it wrote."""
    import torch

    from . import lateralization, routing
    from .layers import check_kind, check_layers, default_layers, num_blocks, routes
    from .sources import find_backbone

    source = find_backbone(args.pipeline)
    blocks = num_blocks(source.config["num_layers"])
    layers = check_layers(args.layers, blocks) if args.layers else None
    model = source.load_backbone()
    progress = not args.no_progress
    if args.command == "lateralization":
        report = lateralization.run_lateralization(
            model, layers or default_layers(blocks), args.output_dir, args.pipeline, progress
        )
        return lateralization.table(report), [args.output_dir / name for name in lateralization.FILES]
    check_kind(model, "routing")
    if layers is None:
        layers = list(range(1, blocks + 1)) if routes(model) else default_layers(blocks)
    pipeline = source.load_pipeline(model).to("cuda" if torch.cuda.is_available() else "cpu")
    settings = routing.SamplerSettings(args.num_inference_steps, args.guidance_scale, args.seed, args.batch_size)
    report = routing.run_routing(pipeline, layers, args.captions, settings, args.output_dir, args.pipeline, progress)
    return routing.table(report), [args.output_dir / name for name in routing.FILES]


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        printed, files = run(args)
    except (ValueError, OSError) as error:
        sys.exit(f"error: {error}")
    print(f"{printed}\n\nWrote {', '.join(map(str, files))}")


if __name__ == "__main__":
    main()
