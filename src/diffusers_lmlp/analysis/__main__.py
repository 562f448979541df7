"""`python -m diffusers_lmlp.analysis` (or `diffusers-lmlp-analysis`): look inside a model. Parsing needs only light
modules: torch, diffusers and the models are imported in `main`."""

import argparse
import json
import os
import sys
from pathlib import Path

from .. import commands
from ..sampling import GUIDANCE_SCALE


CONSOLE_SCRIPT = "diffusers-lmlp-analysis"
# A backbone's files, at the top of a model repo or under transformer/ of a pipeline repo: all a Hub id fetches.
BACKBONE_FILES = [
    "config.json",
    "diffusion_pytorch_model*.safetensors",
    "diffusion_pytorch_model.safetensors.index.json",
]
HUB_ALLOW_PATTERNS = ["model_index.json", *BACKBONE_FILES, *(f"transformer/{name}" for name in BACKBONE_FILES)]


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
    layers = {
        lateralization: "layer numbers as the reference figure script counts (in, mid, out blocks, from 1; default: "
        "the paper's 1, 5, 9, 13, 17 adapted to the depth)",
        routing: "layer numbers, as lateralization counts them (default: every layer of an MoE-MLP, lateralization's "
        "for a U-ViT)",
    }
    for subcommand, layers_help in layers.items():
        subcommand.add_argument(
            "--pipeline", default="shapes",
            help="a pipeline folder, a backbone folder (lateralization only), a Hub id of either, or shapes or emoji "
            "(shipped; default: shapes)",
        )  # fmt: skip
        subcommand.add_argument("--output_dir", type=Path, default=Path("analysis"), help="where the files go")
        subcommand.add_argument("--no_progress", action="store_true", help="no progress bar")
        subcommand.add_argument("--layers", type=commands.number(int, 1), nargs="+", help=layers_help)
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


def find_backbone(name: str):
    """The folder, subfolder, config, family and Hub origin of the backbone `--pipeline` names, loading no weights
    (so `--layers` is checked first)."""
    from ..models.families import family_of
    from ..worlds import WORLDS, pipeline_problem

    from_hub = False
    if name in WORLDS:
        folder = WORLDS[name].pipeline_path
    elif os.path.isdir(name):
        folder = Path(name)
    elif problem := pipeline_problem(name):
        raise OSError(problem)
    else:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

        try:
            folder, from_hub = Path(snapshot_download(name, allow_patterns=HUB_ALLOW_PATTERNS)), True
        except RepositoryNotFoundError:
            raise OSError(f"--pipeline {name}: no such local folder or accessible Hub repo (for a private one, "
                          "`hf auth login`)") from None  # fmt: skip
        except LocalEntryNotFoundError:
            why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
            raise OSError(f"--pipeline {name}: no such local folder, and not in the huggingface_hub cache while "
                          f"{why}: `hf download {name}` it, or pass a local folder") from None  # fmt: skip
    subfolder = "transformer" if (folder / "model_index.json").is_file() else None
    config_file = folder / (subfolder or "") / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--pipeline {name}: {config_file} does not exist. Pass a pipeline or a backbone folder.")
    config = json.loads(config_file.read_text(encoding="utf-8"))
    try:
        return folder, subfolder, config, family_of(config), from_hub
    except ValueError as error:
        raise ValueError(f"--pipeline {name}: {config_file} is not a backbone's config: {error}") from None


def run(args: argparse.Namespace) -> tuple[str, list[Path]]:
    """Run the subcommand; its table and the files it wrote."""
    import torch

    from . import lateralization, routing
    from .layers import check_kind, check_layers, default_layers, num_blocks, routes

    folder, subfolder, config, family, from_hub = find_backbone(args.pipeline)
    blocks = num_blocks(config["num_layers"])
    layers = check_layers(args.layers, blocks) if args.layers else None
    model = family.model_class.from_pretrained(folder, subfolder=subfolder).eval()  # strict, safetensors only
    progress = not args.no_progress
    if args.command == "lateralization":
        report = lateralization.run_lateralization(
            model, layers or default_layers(blocks), args.output_dir, args.pipeline, progress
        )
        return lateralization.table(report), [args.output_dir / name for name in lateralization.FILES]
    check_kind(model, "routing")
    if subfolder is None:
        raise ValueError(f"routing samples captions, and --pipeline {args.pipeline} is a backbone folder: pass the "
                         "folder of its pipeline")  # fmt: skip
    from huggingface_hub.errors import LocalEntryNotFoundError

    from ..pipelines import LMLPPipeline

    try:
        pipeline = LMLPPipeline.from_pretrained(args.pipeline if from_hub else folder, transformer=model)
    except (LocalEntryNotFoundError, FileNotFoundError) as error:
        raise OSError(f"--pipeline {args.pipeline}: {error}") from None
    if layers is None:
        layers = list(range(1, blocks + 1)) if routes(model) else default_layers(blocks)
    pipeline = pipeline.to("cuda" if torch.cuda.is_available() else "cpu")
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
