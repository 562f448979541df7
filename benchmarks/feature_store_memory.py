"""The feature store at scale: memory of the training process, extraction speed, disk, fp16 text states, workers.

Sections (all by default; pick with --sections):

- memory: for each N of --sizes, a synthetic imagefolder of N images with 5 captions each, and a tiny pipeline
  (`diffusers_lmlp.tiny.build_tiny_pipeline`, 77 text tokens); the training script runs `--cache_features` for
  --steps steps in a subprocess, twice: the first run extracts the store, the second finds it (`datasets` prepares
  the imagefolder beforehand, outside the runs). The table gives the extraction time, the peak RSS of each run's
  process (VmHWM at its exit) and the store's bytes per image. The goal: the peak RSS of training does not grow
  with N. `--script` runs another version of the script for comparison (e.g. the
  in-RAM cache of an older commit: `git show <commit>:examples/train_text_to_image.py > old.py`).
- coco: the store's bytes per image for the COCO recipe, from the formula (no run): moments 2·C·h·w float32 + 8 B of
  caption offsets per image, T·D per caption in float32 (4 B) or float16 (2 B).
- real-size: extraction speed (on this machine's CPU) with encoders of real size and random weights: an
  AutoencoderKL of SD's KL-f8 layout at 256 px and a CLIP ViT-L/14-shaped text encoder (12 layers, 768 wide, 77
  tokens), on --real-size-images images with 5 captions each; extrapolated per 1,000 images.
- workers: the step rate of the embedded default (the shapes world) with 0 and 2 `--dataloader_num_workers`, from
  the runs' training_summary.json (train_seconds).
- dtype: the loss curves of the shapes world with the text states stored in float32 and in float16, read from the
  runs' tensorboard logs.

    python benchmarks/feature_store_memory.py                                  # everything (about 20 minutes on 2 CPUs)
    python benchmarks/feature_store_memory.py --sections memory --sizes 1000 20000
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from speed_vs_uvit import SD_VAE_CONFIG  # this folder's speed benchmark: the SD VAE both papers decode with


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_text_to_image.py"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
SECTIONS = ["coco", "memory", "real-size", "workers", "dtype"]
WORDS = "a red blue green yellow big small circle square triangle on the left right top bottom of an image".split()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS)
    parser.add_argument("--sizes", nargs="+", type=int, default=[1000, 20000], help="memory: the dataset sizes")
    parser.add_argument("--steps", type=int, default=100, help="memory: training steps of each run")
    parser.add_argument("--script", type=Path, default=SCRIPT, help="memory: the training script to measure")
    parser.add_argument(
        "--data-format", choices=["imagefolder", "parquet"], default="imagefolder",
        help="memory: an imagefolder of PNGs (--train_data_dir) or one parquet file of embedded images (--dataset_name)",
    )  # fmt: skip
    parser.add_argument("--real-size-images", type=int, default=8, help="real-size: images to extract")
    parser.add_argument("--shapes-steps", type=int, default=200, help="workers and dtype: steps of the shapes runs")
    parser.add_argument("--workdir", type=Path, help="where data, stores and runs go (default: a temporary folder)")
    return parser.parse_args()


# Runs a Python script (argv[1:]) and, at its exit, writes the peak RSS of its process (VmHWM) to stderr. VmHWM
# starts afresh at exec, so unlike the child's ru_maxrss it does not count the pages shared with the parent at fork.
PEAK_RSS = """
import atexit, runpy, sys


def report():
    with open("/proc/self/status") as status:
        sys.stderr.write("\\n" + next(line for line in status if line.startswith("VmHWM")))


atexit.register(report)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(argv: list[str], log: Path) -> tuple[str, int]:
    """Run a Python script to the end; return its stderr and the peak RSS of its process, in bytes.

    Args:
        argv (`list[str]`): The script and its arguments.
        log (`Path`): Where its stderr goes.
    """
    with open(log, "w") as err:
        result = subprocess.run(
            [sys.executable, "-c", PEAK_RSS, *argv], env=ENV, stdout=subprocess.DEVNULL, stderr=err
        )
    text = log.read_text()
    if result.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({result.returncode}):\n{text[-3000:]}")
    return text, int(re.findall(r"VmHWM:\s+(\d+) kB", text)[-1]) * 1024


def write_data(folder: Path, n: int, data_format: str) -> None:
    """N random 24×20 px images with 5 captions each: an imagefolder of PNGs with metadata.jsonl, or one parquet file.

    Args:
        folder (`Path`): Created.
        n (`int`): The number of images.
        data_format (`str`): `"imagefolder"` or `"parquet"`.
    """
    import datasets

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)) for _ in range(n)]
    captions = [[" ".join(rng.choice(WORDS, size=8)) for _ in range(5)] for _ in range(n)]
    if data_format == "parquet":
        rows = datasets.Dataset.from_dict({"image": images, "text": captions}).cast_column("image", datasets.Image())
        rows.to_parquet(str(folder / "train.parquet"))
        return
    with open(folder / "metadata.jsonl", "w") as f:
        for i, (image, texts) in enumerate(zip(images, captions)):
            image.save(folder / f"{i:06d}.png")
            f.write(json.dumps({"file_name": f"{i:06d}.png", "text": texts}) + "\n")


def store_bytes(cache: Path) -> int:
    """The size of the feature store(s) under a --cache_dir.

    Args:
        cache (`Path`): The --cache_dir.
    """
    return sum(p.stat().st_size for p in (cache / "features").rglob("*") if p.is_file())


def memory(args, workdir: Path) -> None:
    import datasets

    from diffusers_lmlp.tiny import build_tiny_pipeline

    build_tiny_pipeline(text_seq_len=77).save_pretrained(workdir / "tiny")
    print(f"\n## memory: {args.script.relative_to(ROOT) if args.script.is_relative_to(ROOT) else args.script}, "
          f"{args.data_format}, {args.steps} steps of batch 16, tiny pipeline (16 px, 77 × 32 text states)\n")  # fmt: skip
    print("| N | extraction s | s per 1k images | peak RSS, extract+train run | peak RSS, train run | store B/image |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.sizes:
        data, cache = workdir / f"{args.data_format}-{n}", workdir / f"cache-{args.data_format}-{n}"
        if not data.is_dir():
            write_data(data, n, args.data_format)
        shutil.rmtree(cache / "features", ignore_errors=True)
        # `datasets` prepares the data here, in the cache the script reads: the runs measure the store alone.
        if args.data_format == "parquet":
            datasets.load_dataset(str(data), cache_dir=str(cache / "datasets"))
            source = ["--dataset_name", str(data)]
        else:
            datasets.load_dataset("imagefolder", data_dir=str(data), cache_dir=str(cache / "datasets"))
            source = ["--train_data_dir", str(data)]
        peaks = []
        for attempt in ("extract", "train"):
            out = workdir / f"run-{n}-{attempt}"
            shutil.rmtree(out, ignore_errors=True)
            argv = [
                str(args.script), "--pretrained_model_name_or_path", str(workdir / "tiny"),
                *source, "--resolution", "16", "--train_batch_size", "16",
                "--max_train_steps", str(args.steps), "--checkpointing_steps", "1000000", "--cache_features",
                "--cache_dir", str(cache), "--output_dir", str(out), "--report_to", "none",
            ]  # fmt: skip
            text, peak = run(argv, workdir / f"run-{n}-{attempt}.log")
            peaks.append(peak)
            if attempt == "extract":
                seconds = float(re.search(r"images ready in ([\d.]+) s", text).group(1))
        size = store_bytes(cache) / n
        print(f"| {n:,} | {seconds:.1f} | {seconds / n * 1000:.1f} | {peaks[0] / 2**20:,.0f} MiB | "
              f"{peaks[1] / 2**20:,.0f} MiB | {size:,.0f} |", flush=True)  # fmt: skip


def coco() -> None:
    images, captions = 82_783, 414_113  # COCO-2014 train
    moments, offsets, state = 2 * 4 * 32 * 32 * 4, 8, 77 * 768
    print("\n## coco: the COCO recipe's store (SD VAE at 256 px, CLIP L/14, train2014)\n")
    print("| text states | per image (5 captions) | train2014 (82,783 images, 414,113 captions) |")
    print("|---|---:|---:|")
    for dtype, itemsize in (("float32", 4), ("float16", 2)):
        per_image = moments + offsets + 5 * state * itemsize
        total = images * (moments + offsets) + captions * state * itemsize
        print(
            f"| {dtype} | {moments:,} + {offsets} + 5 × {state * itemsize:,} = {per_image:,} B | {total / 1e9:.1f} GB |"
        )


def real_size(args, workdir: Path) -> None:
    import datasets
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffusers_lmlp.tiny import tiny_clip_tokenizer
    from diffusers_lmlp.training import extract_features

    torch.manual_seed(0)
    vae = AutoencoderKL(**SD_VAE_CONFIG).eval()
    tokenizer = tiny_clip_tokenizer(model_max_length=77)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
            max_position_embeddings=77, hidden_act="quick_gelu",
        )
    ).eval()  # fmt: skip
    rng = np.random.default_rng(0)
    n = args.real_size_images
    rows = {
        "image": [Image.fromarray(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)) for _ in range(n)],
        "text": [[" ".join(rng.choice(WORDS, size=10)) for _ in range(5)] for _ in range(n)],
    }
    dataset = datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image())
    timings = {}
    for dtype in ("float32", "float16"):
        path = workdir / f"real-size-{dtype}"
        shutil.rmtree(path, ignore_errors=True)
        start = time.perf_counter()
        extract_features(path, dataset, image_column="image", caption_column="text", resolution=256,
                         tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, text_dtype=dtype, batch_size=8)  # fmt: skip
        timings[dtype] = (time.perf_counter() - start, sum(p.stat().st_size for p in path.iterdir()) / n)
    print(f"\n## real-size: SD KL-f8 VAE layout at 256 px + CLIP L/14-shaped text encoder, random weights, "
          f"{n} images of 640×480 with 5 captions, on CPU ({torch.get_num_threads()} threads)\n")  # fmt: skip
    print("| text states | seconds | per 1k images (extrapolated) | store B/image |")
    print("|---|---:|---:|---:|")
    for dtype, (seconds, size) in timings.items():
        print(f"| {dtype} | {seconds:.1f} | {seconds / n * 1000 / 60:.0f} min | {size:,.0f} |")


def shapes_run(args, workdir: Path, name: str, *extra: str) -> Path:
    """The embedded default for --shapes-steps steps; return its output folder.

    Args:
        args (`argparse.Namespace`): The benchmark's arguments.
        workdir (`Path`): The benchmark's folder (its `shapes-cache` is shared by the runs).
        name (`str`): The run's folder name.
        *extra (`str`): More arguments.
    """
    out = workdir / name
    shutil.rmtree(out, ignore_errors=True)
    argv = [
        str(SCRIPT), "--max_train_steps", str(args.shapes_steps), "--output_dir", str(out),
        "--cache_dir", str(workdir / "shapes-cache"), *extra,
    ]  # fmt: skip
    run(argv, workdir / f"{name}.log")
    return out


def workers(args, workdir: Path) -> None:
    shapes_run(args, workdir, "shapes-warm-up", "--max_train_steps", "1", "--report_to", "none")  # extracts
    print(f"\n## workers: the shapes world, {args.shapes_steps} steps (train_seconds of training_summary.json)\n")
    print("| --dataloader_num_workers | train seconds | steps/s |")
    print("|---:|---:|---:|")
    for count in (0, 2, 0, 2):  # interleaved: the machine's load drifts
        out = shapes_run(args, workdir, f"shapes-workers-{count}", "--dataloader_num_workers", str(count),
                         "--report_to", "none")  # fmt: skip
        seconds = json.loads((out / "training_summary.json").read_text())["train_seconds"]
        print(f"| {count} | {seconds:.1f} | {args.shapes_steps / seconds:.2f} |", flush=True)


def losses(out: Path) -> dict[int, float]:
    """The logged loss of each step of a run, from its tensorboard event files.

    Args:
        out (`Path`): The run's output folder.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for folder in {p.parent for p in out.rglob("events.out.tfevents*")}:
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0}).Reload()
        if "loss" in events.Tags()["scalars"]:
            found.update({e.step: e.value for e in events.Scalars("loss")})
    return found


def dtype(args, workdir: Path) -> None:
    curves = {
        name: losses(
            shapes_run(args, workdir, f"shapes-{name}", "--cache_text_dtype", name, "--report_to", "tensorboard")
        )
        for name in ("float32", "float16")
    }
    steps = sorted(curves["float32"])
    window = max(1, len(steps) // 10)
    print(
        f"\n## dtype: the shapes world's loss, text states stored in float32 and float16 (mean over {window} steps)\n"
    )
    print("| steps | float32 | float16 | difference |")
    print("|---|---:|---:|---:|")
    for start in range(0, len(steps), window):
        chunk = steps[start : start + window]
        a, b = (float(np.mean([curves[name][s] for s in chunk])) for name in ("float32", "float16"))
        print(f"| {chunk[0]}-{chunk[-1]} | {a:.4f} | {b:.4f} | {b - a:+.4f} |")
    largest = max(abs(curves["float32"][s] - curves["float16"][s]) for s in steps)
    print(f"\nlargest difference of a step's loss over the {len(steps)} steps: {largest:.2e}")
    first = steps[:5]
    print(f"\nfirst steps, float32: {[round(curves['float32'][s], 5) for s in first]}")
    print(f"first steps, float16: {[round(curves['float16'][s], 5) for s in first]}")


def main() -> None:
    args = parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="feature-store-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"# feature store benchmark ({os.cpu_count()} CPUs; work folder {workdir})")
    for section in args.sections:
        if section == "coco":
            coco()
        elif section == "memory":
            memory(args, workdir)
        elif section == "real-size":
            real_size(args, workdir)
        elif section == "workers":
            workers(args, workdir)
        elif section == "dtype":
            dtype(args, workdir)


if __name__ == "__main__":
    main()
