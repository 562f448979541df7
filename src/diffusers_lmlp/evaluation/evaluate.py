"""Sample a pipeline on captions and score the images: FID, CLIP score and, on the shapes world, the shapes scorer.

Image i of an evaluation is sampled from caption i with its own generator, seeded by (seed, i), so an image does
not depend on the batch it is in or on the process that samples it. Batch k (images k·B to k·B + B − 1) goes to
process k mod P; the feature sums are added up across processes and the per-image scores gathered, so P processes
give the result of one, for the same seed.
"""

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm.auto import tqdm

from ..image_grid import make_image_grid
from .clip_score import CLIPScorer
from .extractors import (
    INCEPTION,
    SHAPES,
    extractor_name,
    feature_size,
    image_features,
    images_to_tensor,
    load_extractor,
)
from .fid import FeatureMoments, FIDStatistics, frechet_distance
from .intervals import bootstrap_intervals
from .reference import SHAPES_REFERENCE, check_exists, reference_statistics


GRID_SIZE = 16  # images in the report's grid: the first ones
ATTRIBUTES = ("colour", "shape", "position", "size")
# One row per image in the gathered scores: index, CLIP score, then the shapes scorer's attributes (NaN if unused or
# unstated by the caption).
COLUMNS = ("index", "clip_score", *ATTRIBUTES)


@dataclass
class Processes:
    """Which part of the work this process does.

    Args:
        index (`int`): This process's rank.
        count (`int`): How many processes share the work.
        device (`torch.device`): Where the process group communicates.
    """

    index: int = 0
    count: int = 1
    device: torch.device = torch.device("cpu")

    @classmethod
    def from_state(cls, state) -> "Processes":
        """From an `accelerate.PartialState` (or `Accelerator`)."""
        return cls(state.process_index, state.num_processes, state.device)

    def batches(self, num_items: int, batch_size: int) -> list[range]:
        """This process's batches: every `count`-th of the `batch_size` slices of `range(num_items)`."""
        starts = range(self.index * batch_size, num_items, self.count * batch_size)
        return [range(start, min(start + batch_size, num_items)) for start in starts]

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every process's rows (N_p, C), concatenated; padding rows (first column −1) are dropped."""
        if self.count == 1:
            return rows
        from accelerate.utils import gather, pad_across_processes

        padded = pad_across_processes(rows.to(self.device), dim=0, pad_index=-1)
        gathered = gather(padded).cpu()
        return gathered[gathered[:, 0] >= 0]

    def wait(self) -> None:
        """Wait until every process arrives here."""
        if self.count > 1:
            torch.distributed.barrier()


def image_seed(seed: int, index: int) -> int:
    """The noise seed of image `index` of an evaluation seeded with `seed` (distinct for every pair)."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0] >> 1)


def is_shapes_world(captions: list[str]) -> bool:
    """Whether every caption is a shapes-world caption (then the shapes scorer reads the images)."""
    from ..shapes.scorer import parse_caption

    try:
        for caption in captions:
            parse_caption(caption)
    except ValueError:
        return False
    return True


def shapes_flags(image: Image.Image, caption: str) -> list[float]:
    """The shapes scorer's verdict per attribute, as 1.0 / 0.0, or NaN for one the caption leaves unstated."""
    from ..shapes.scorer import score_image

    verdict = score_image(image, caption)
    return [float(verdict.get(key, float("nan"))) for key in ATTRIBUTES]


@torch.no_grad()
def evaluate(
    pipeline,
    captions: list[str],
    *,
    fid_reference: str | Path | FIDStatistics | None = None,
    fid_extractor: str | torch.nn.Module | None = None,
    clip_model: str | CLIPScorer | None = None,
    num_inference_steps: int = 50,
    guidance_scale: float = 2.0,
    batch_size: int = 50,
    seed: int = 0,
    image_dir: str | Path | None = None,
    processes: Processes | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> tuple[dict, Image.Image]:
    """Sample one image per caption and score them.

    Args:
        pipeline (`LMLPPipeline`): The pipeline, on its device.
        captions (`list[str]`): Image i is sampled from caption i (see `draw_captions`).
        fid_reference (`str`, `Path` or `FIDStatistics`, *optional*): What FID compares with: an `.npz` of `mu` and
            `sigma` (e.g. U-ViT's `fid_stats_mscoco256_val.npz`), a folder of real images (its statistics are
            computed once, with the protocol's centre crop and resize to the generated size, and cached), or
            `"shapes"`: renders of the same captions by the shapes world. No FID without it.
        fid_extractor (`str` or `torch.nn.Module`, *optional*): The feature network: `"inception"` (the papers'),
            `"shapes"`, or a module mapping (B, 3, H, W) images in [0, 1] to (B, D). Defaults to `"shapes"` for the
            shapes reference and `"inception"` otherwise.
        clip_model (`str` or `CLIPScorer`, *optional*): A CLIP model id or folder (e.g.
            `"openai/clip-vit-large-patch14"`) or a loaded scorer; no CLIP score without it.
        num_inference_steps (`int`, *optional*, defaults to 50): Sampling steps.
        guidance_scale (`float`, *optional*, defaults to 2.0): Classifier-free guidance (the papers' s = 1).
        batch_size (`int`, *optional*, defaults to 50): Images per pipeline call (the reference's 50).
        seed (`int`, *optional*, defaults to 0): Seeds every image's noise, and the shapes reference's renders.
        image_dir (`str` or `Path`, *optional*): Save the images there as `<index>.png` (with a `metadata.jsonl` of
            the captions, a 🤗 imagefolder).
        processes (`Processes`, *optional*): This process's share of a multi-process evaluation; one process when
            not given.
        cache_dir (`str` or `Path`, *optional*): Where the statistics of reference folders are cached.
        progress (`bool`, *optional*, defaults to `True`): Show a progress bar (on the first process).

    Returns:
        `tuple[dict, PIL.Image.Image]`: The report (the same on every process) and a grid of the first images.

    Raises:
        `ValueError`: For bad arguments, or reference statistics of another feature network, before any sampling.
    """
    processes = processes or Processes()
    if not captions:
        raise ValueError("Pass at least one caption to evaluate")
    if batch_size < 1:
        raise ValueError(f"The batch size must be positive; got {batch_size}")
    started = time.perf_counter()
    resolution = pipeline.native_size
    shapes = is_shapes_world(captions)
    extractor = reference = None
    if fid_reference is not None:
        shapes_reference = isinstance(fid_reference, str) and fid_reference == SHAPES_REFERENCE
        if shapes_reference and not shapes:
            raise ValueError(
                "The 'shapes' FID reference renders the captions with the shapes world, but some captions are not "
                "shapes-world captions (e.g. 'a {size} {colour} {shape} at the {position}')"
            )
        if not shapes_reference:
            check_exists(fid_reference)
        extractor = load_extractor(fid_extractor or (SHAPES if shapes_reference else INCEPTION))
        extractor = extractor.to(processes.device)
        if not shapes_reference:
            reference = reference_statistics(
                fid_reference, extractor, resolution, processes=processes, cache_dir=cache_dir, progress=progress
            )
        num_features = feature_size(extractor, resolution)
        # The generated images, the shapes reference's renders, and a second set of renders for the floor.
        generated, renders, floor = (FeatureMoments(num_features) for _ in range(3))
    elif fid_extractor is not None:
        raise ValueError("A FID feature network was given without `fid_reference`: pass what FID compares with")
    scorer = (
        CLIPScorer.from_pretrained(clip_model, device=processes.device) if isinstance(clip_model, str) else clip_model
    )
    if image_dir is not None:
        Path(image_dir).mkdir(parents=True, exist_ok=True)

    rows, grid_rows, grid_images = [], [], []
    batches = processes.batches(len(captions), batch_size)
    bar = tqdm(
        total=len(captions),
        desc="sampling",
        unit="img",
        disable=not progress or processes.index != 0,
    )
    pipeline.set_progress_bar_config(disable=True)
    for batch in batches:
        prompts = [captions[i] for i in batch]
        generators = [torch.Generator().manual_seed(image_seed(seed, i)) for i in batch]
        images = pipeline(
            prompts, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, generator=generators
        ).images
        if extractor is not None:
            generated.update(image_features(extractor, images_to_tensor(images)))
            if reference is None:
                renders.update(
                    image_features(extractor, images_to_tensor(shapes_renders(prompts, batch, seed, 1, resolution)))
                )
                floor.update(
                    image_features(extractor, images_to_tensor(shapes_renders(prompts, batch, seed, 2, resolution)))
                )
        clip = scorer.score(images, prompts) if scorer is not None else torch.full((len(batch),), float("nan"))
        for position, (index, image, prompt) in enumerate(zip(batch, images, prompts)):
            flags = shapes_flags(image, prompt) if shapes else [float("nan")] * len(ATTRIBUTES)
            rows.append([index, float(clip[position]), *flags])
            if index < GRID_SIZE:
                grid_rows.append(index)
                grid_images.append(torch.from_numpy(np.array(image.convert("RGB"))))
            if image_dir is not None:
                image.save(Path(image_dir) / f"{index:06d}.png")
        bar.update(min(len(batch) * processes.count, bar.total - bar.n))  # the first process's pace, for all
    bar.close()

    scores = processes.gather(torch.tensor(rows, dtype=torch.float64).view(-1, len(COLUMNS)))
    scores = scores[scores[:, 0].argsort()]
    grid = gathered_grid(processes, grid_rows, grid_images, resolution, captions)
    report = {
        "model": str(pipeline.name_or_path or "(an unsaved pipeline)"),
        "num_images": len(captions),
        "seed": seed,
        "sampler": {
            "scheduler": type(pipeline.scheduler).__name__,
            "num_inference_steps": num_inference_steps,
            "guidance_scale": guidance_scale,
            "batch_size": batch_size,
            "dtype": str(pipeline.transformer.dtype).removeprefix("torch."),
            "resolution": resolution,
        },
        "num_processes": processes.count,
    }
    if extractor is not None:
        report.update(fid_results(extractor, reference, fid_reference, generated, renders, floor, processes))
    if scorer is not None:
        values = scores[:, COLUMNS.index("clip_score")]
        report.update(clip_score=float(values.mean()), clip_score_std=float(values.std()), clip_model=scorer.name)
    if shapes:
        from ..shapes.scorer import accuracies

        flags = scores[:, COLUMNS.index(ATTRIBUTES[0]) :].tolist()  # (N, 4)
        report["shapes"] = accuracies(
            [{key: bool(flag) for key, flag in zip(ATTRIBUTES, row) if not np.isnan(flag)} for row in flags]
        )
        # 95% intervals, resampling captions with all their images (several seeds of one caption are not independent)
        report["shapes_intervals"] = bootstrap_intervals(np.array(flags), captions, seed=seed)
    report["seconds"] = round(time.perf_counter() - started, 1)
    if image_dir is not None and processes.index == 0:
        with open(Path(image_dir) / "metadata.jsonl", "w", encoding="utf-8") as f:
            for index, caption in enumerate(captions):
                f.write(json.dumps({"file_name": f"{index:06d}.png", "text": caption}) + "\n")
    return report, grid


def shapes_renders(prompts: list[str], batch: range, seed: int, stream: int, resolution: int) -> list[Image.Image]:
    """Real shapes-world images of the captions, each with its own jitter, seeded by (seed, stream, index); a caption
    that leaves the size unstated gets a size drawn first from the same generator."""
    from ..shapes.scorer import parse_caption
    from ..shapes.world import SIZES, render

    images = []
    for prompt, index in zip(prompts, batch):
        spec, rng = parse_caption(prompt), np.random.default_rng([seed, stream, index])
        if spec.size is None:
            spec = replace(spec, size=SIZES[rng.integers(len(SIZES))])
        images.append(render(spec, resolution, rng))
    return images


def fid_results(extractor, reference, fid_reference, generated, renders, floor, processes) -> dict:
    """FID of the generated features against the reference (and, for the shapes reference, the floor: a second set
    of real renders against the first)."""
    name = extractor_name(extractor)
    for moments in (generated, renders, floor) if reference is None else (generated,):
        moments.reduce(processes.device)
    samples = generated.statistics(name)
    if reference is None:  # the shapes world's renders of the same captions
        reference = renders.statistics(name)
        results = {"fid_floor": frechet_distance(floor.statistics(name), reference)}
        source = f"{SHAPES_REFERENCE} (renders of the same captions, {reference.num_images} images)"
    else:
        results = {}
        source = str(fid_reference) if not isinstance(fid_reference, FIDStatistics) else "FIDStatistics"
    return {
        "fid": frechet_distance(samples, reference),
        **results,
        "fid_reference": source,
        "fid_reference_images": reference.num_images,
        "fid_extractor": name,
    }


def gathered_grid(processes, indices: list[int], images: list[torch.Tensor], resolution: int, captions) -> Image.Image:
    """A captioned grid of the first `GRID_SIZE` images, gathered from the processes that sampled them."""
    pixels = torch.stack(images).flatten(1) if images else torch.zeros(0, resolution * resolution * 3)  # (n, H·W·3)
    rows = torch.cat([torch.tensor(indices, dtype=torch.float64)[:, None], pixels.double()], dim=1)
    rows = processes.gather(rows)
    rows = rows[rows[:, 0].argsort()]
    grid = [Image.fromarray(row[1:].view(resolution, resolution, 3).to(torch.uint8).numpy()) for row in rows]
    return make_image_grid(grid, captions=[captions[int(i)] for i in rows[:, 0]])
