"""What a visitor of the Space waits for on a CPU: one request, sampled eagerly against with the transformer frozen.

The script serves a model as `spaces/lmlp-demo/app.py` does (`--model`: the shipped shapes model by default, the
shipped emoji model, or a local pipeline folder) and times the app's own generate function on one request, by default
the app's defaults (4 images, 50 steps, guidance 2.0). One pipeline samples with the transformer as it is (`LMLP_FREEZE=0`),
the other frozen by the app's `serve_frozen` (the default on a CPU), timed in turn over `--rounds`, in float32 and,
where the CPU runs it natively, in bf16 (the app serves in bf16 where it measures bf16 faster). It prints the
median seconds of a request, the frozen one's speed-up, the compilation at start-up, and the largest difference
between the two pipelines' pixels (0–255) for the same seed.

    python benchmarks/space_sampling.py
    python benchmarks/space_sampling.py --num_images 1 --rounds 9

Run it on idle cores: only ratios measured in one window are claims.
"""

import argparse
import importlib.util
import statistics
import time

import numpy as np
import torch

from diffusers_lmlp.commands import number
from diffusers_lmlp.cpu import this_cpu
from diffusers_lmlp.hub.space import DEFAULT_SPACE_DIR


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_app():
    """The Space's `app.py` as a module (it is a script of its folder, not a module of the package)."""
    spec = importlib.util.spec_from_file_location("lmlp_space_app", DEFAULT_SPACE_DIR / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default="shapes", help="a local pipeline folder, or a shipped model: shapes (default) or emoji"
    )
    parser.add_argument(
        "--precisions", nargs="+", choices=sorted(PRECISIONS), help="default: fp32, and bf16 where it is native"
    )
    parser.add_argument(
        "--num_images", type=number(int, 1), default=4, help="images per request (the app's default: 4)"
    )
    parser.add_argument("--num_inference_steps", type=number(int, 1), default=50, help="steps (the app's default: 50)")
    parser.add_argument("--guidance_scale", type=float, default=2.0, help="guidance (the app's default: 2.0)")
    parser.add_argument("--rounds", type=number(int, 1), default=5, help="timed requests of each pipeline, in turn")
    args = parser.parse_args(argv)
    if args.precisions is None:
        args.precisions = ["fp32"] + (["bf16"] if this_cpu().native_bf16 else [])
    return args


def time_requests(generators: dict, request: tuple, rounds: int) -> dict[str, float]:
    """Median seconds of a request to each of `generators` (the app's generate functions), timed in turn."""
    seconds = {name: [] for name in generators}
    for _ in range(rounds):
        for name, generate in generators.items():
            started = time.perf_counter()
            generate(*request)
            seconds[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in seconds.items()}


def measure(app, args: argparse.Namespace, precision: str) -> dict:
    """One precision's row: both pipelines loaded as the app loads them, one frozen, then timed."""
    dtype = PRECISIONS[precision]
    eager, frozen = app.load_pipeline(args.model, dtype), app.load_pipeline(args.model, dtype)
    started = time.perf_counter()
    line = app.serve_frozen(frozen)
    compile_seconds = time.perf_counter() - started
    if not frozen.inductor_freezing_enabled:
        raise SystemExit(f"{precision}: the app could not freeze the transformer here: {line}")
    generators = {"eager": app.make_generate_fn(eager), "frozen": app.make_generate_fn(frozen)}
    # (prompt, negative prompt, seed, randomize seed, steps, guidance, images), as the UI and the API send them
    described = app.describe_model(eager, app.SHIPPED.get(args.model, args.model))
    prompt = app.examples_for(described)[0]  # as the app opens
    request = (prompt, "", 0, False, args.num_inference_steps, args.guidance_scale, args.num_images)
    images = {name: generate(*request)[0] for name, generate in generators.items()}  # also the warm-up
    difference = max(
        int(np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16)).max())
        for a, b in zip(images["eager"], images["frozen"], strict=True)
    )
    seconds = time_requests(generators, request, args.rounds)
    return {
        "precision": precision,
        "eager": seconds["eager"],
        "frozen": seconds["frozen"],
        "compile": compile_seconds,
        "difference": difference,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    app = load_app()
    rows = [measure(app, args, precision) for precision in args.precisions]
    model = f"the shipped {args.model} model" if args.model in app.SHIPPED else args.model
    print(
        f"The Space's request ({args.num_images} image(s), {args.num_inference_steps} steps, guidance "
        f"{args.guidance_scale:g}) on {model}, median of {args.rounds}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; CPU: {this_cpu().describe()}"
    )
    print()
    print("| precision | eager s | frozen s | frozen speed-up | compiled at start-up s | largest pixel difference |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['precision']} | {row['eager']:.3f} | {row['frozen']:.3f} | {row['eager'] / row['frozen']:.2f}× "
            f"| {row['compile']:.1f} | {row['difference']} |"
        )
    return rows


if __name__ == "__main__":
    main()
