"""Sample a pipeline on captions and score the images: FID, CLIP score and, on an embedded world, its scorer. Image i
is seeded by (seed, i) and batch k goes to process k mod P, so P processes report what one does."""

import hashlib
import json
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..durable import write_durably
from ..image_grid import make_image_grid
from ..image_tensors import images_to_tensor
from ..progress import progress_bar
from ..sampling import GUIDANCE_SCALE, NUM_INFERENCE_STEPS
from ..worlds import WORLDS, World, load, world_of
from .clip_score import CLIPScorer
from .fid import (
    INCEPTION,
    FeatureMoments,
    FIDStatistics,
    extractor_name,
    feature_size,
    frechet_distance,
    image_features,
    load_extractor,
    reference_statistics,
)
from .resume import BatchResult, EvaluationInterrupted, ProgressStore, pipeline_digest, tensors_digest


GRID_SIZE = 16  # the report grid shows the first images
COLUMNS = ("index", "clip_score")  # a score row's first columns; the world scorer's `FLAGS` follow (NaN: not asked)
# A batch's FID features; with a world's reference also real images of its captions and a second set (the floor).
FEATURES = ("generated", "renders", "floor")


@dataclass
class Processes:
    """This process's share of the work: its `index`, the process `count`, and the `device` they communicate on."""

    index: int = 0
    count: int = 1
    device: torch.device = torch.device("cpu")

    def batches(self, num_items: int, batch_size: int) -> list[range]:
        """This process's batches: every `count`-th of the `batch_size` slices of `range(num_items)`."""
        starts = range(self.index * batch_size, num_items, self.count * batch_size)
        return [range(start, min(start + batch_size, num_items)) for start in starts]

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every process's (N_p, C) rows, concatenated; padding rows (first column −1) are dropped."""
        if self.count == 1:
            return rows
        from accelerate.utils import gather, pad_across_processes

        gathered = gather(pad_across_processes(rows.to(self.device), dim=0, pad_index=-1)).cpu()
        return gathered[gathered[:, 0] >= 0]

    def wait(self) -> None:
        if self.count > 1:
            torch.distributed.barrier()


def image_seed(seed: int, index: int) -> int:
    """The noise seed of image `index` of an evaluation seeded with `seed` (distinct for every pair)."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0] >> 1)


@dataclass
class Scoring:
    """What scores the images (a None part is not scored). With an extractor but no reference, FID compares with the
    world's real images of the same captions."""

    extractor: torch.nn.Module | None
    reference: FIDStatistics | None
    reference_name: str | None
    num_features: int
    scorer: CLIPScorer | None
    world: World | None
    world_scorer: object | None
    resolution: int
    seed: int

    @property
    def columns(self) -> tuple[str, ...]:
        return COLUMNS + (tuple(self.world_scorer.FLAGS) if self.world_scorer is not None else ())

    @property
    def feature_names(self) -> tuple[str, ...]:
        if self.extractor is None:
            return ()
        return FEATURES if self.reference is None else FEATURES[:1]

    def score(self, images: list[Image.Image], prompts: list[str], batch: range) -> BatchResult:
        """The batch's FID features, per-image score rows and grid images (its `seconds` left at 0)."""
        features = {}
        if self.extractor is not None:
            features["generated"] = image_features(self.extractor, images_to_tensor(images))  # (B, D)
            if self.reference is None:
                for stream, name in enumerate(FEATURES[1:], start=1):
                    renders = self.world_scorer.renders(prompts, batch, self.seed, stream, self.resolution)
                    features[name] = image_features(self.extractor, images_to_tensor(renders))  # (B, D)
        clip = self.scorer.score(images, prompts) if self.scorer is not None else torch.full((len(batch),), np.nan)
        flags = self.world_scorer.flags(images, prompts) if self.world_scorer is not None else [[]] * len(batch)
        rows = [[index, float(clip[position]), *flags[position]] for position, index in enumerate(batch)]
        rows = torch.tensor(rows, dtype=torch.float64).view(len(batch), len(self.columns))  # (B, C)
        grid = [torch.from_numpy(np.array(im.convert("RGB"))) for i, im in zip(batch, images) if i < GRID_SIZE]
        grid = torch.stack(grid) if grid else torch.zeros(0, self.resolution, self.resolution, 3, dtype=torch.uint8)
        return BatchResult(rows, features, grid, 0.0)  # grid: (n, H, W, 3)

    def report(self, tally: "Tally", processes: Processes, captions: list[str]) -> dict:
        """FID (with a world's reference also the floor: real images against real ones), CLIP score and the world
        scorer's accuracies with their 95% intervals."""
        report = {}
        if self.extractor is not None:
            name = extractor_name(self.extractor)
            if processes.count > 1:
                for moments in tally.moments.values():
                    moments.reduce(processes.device)
            samples = tally.moments["generated"].statistics(name)
            reference, source = self.reference, self.reference_name
            if reference is None:  # the world's real images of the same captions
                reference = tally.moments["renders"].statistics(name)
                report["fid_floor"] = frechet_distance(tally.moments["floor"].statistics(name), reference)
                source = f"{self.world.name} (real images of the same captions, {reference.num_images} images)"
            report = {"fid": frechet_distance(samples, reference), **report, "fid_reference": source}
            report.update(fid_reference_images=reference.num_images, fid_extractor=name)
        scores = processes.gather(tally.scores())
        scores = scores[scores[:, 0].argsort()]  # (N, C), by image index
        if self.scorer is not None:
            values = scores[:, COLUMNS.index("clip_score")]
            report.update(
                clip_score=float(values.mean()), clip_score_std=float(values.std()), clip_model=self.scorer.name
            )
        if self.world_scorer is not None:
            names, flags = self.world_scorer.FLAGS, scores[:, len(COLUMNS) :].numpy()  # (N, F)
            report[self.world.name] = self.world_scorer.accuracies(
                [{key: bool(flag) for key, flag in zip(names, row) if not np.isnan(flag)} for row in flags]
            )
            # Resample captions with all their images: several seeds of one caption are not independent.
            scored = [captions[int(index)] for index in scores[:, 0]]
            report[f"{self.world.name}_intervals"] = self.world_scorer.intervals(flags, scored, self.seed)
        return report


class Tally:
    """The results of the batches so far: FID feature moments, per-image score rows and the grid's images."""

    def __init__(self, scoring: Scoring):
        self.num_columns = len(scoring.columns)
        self.moments = {name: FeatureMoments(scoring.num_features) for name in scoring.feature_names}
        self.rows, self.grid = [], []  # (B, C) and (n, H, W, 3) per batch
        self.resumed_seconds = 0.0  # the sampling time of the batches taken from a `resume_dir`

    def add(self, result: BatchResult) -> None:
        for name, moments in self.moments.items():
            moments.update(result.features[name])
        self.rows.append(result.rows)
        self.grid.append(result.grid)

    def scores(self) -> torch.Tensor:
        """(N, C): every image's row (see `COLUMNS`)."""
        return torch.cat(self.rows) if self.rows else torch.zeros(0, self.num_columns, dtype=torch.float64)


@torch.no_grad()
def evaluate(
    pipeline,
    captions: list[str],
    *,
    fid_reference: str | Path | FIDStatistics | None = None,
    fid_extractor: str | torch.nn.Module | None = None,
    clip_model: str | CLIPScorer | None = None,
    num_inference_steps: int = NUM_INFERENCE_STEPS,
    guidance_scale: float = GUIDANCE_SCALE,
    batch_size: int = 50,
    seed: int = 0,
    image_dir: str | Path | None = None,
    processes: Processes | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    resume_dir: str | Path | None = None,
) -> tuple[dict, Image.Image]:
    """Sample image i from caption i and score them; return the report (the same on every process) and a grid of the
    first images. Bad arguments raise `ValueError` before any sampling.

    `fid_reference`: an `.npz` of `mu` and `sigma`, a folder of real images (statistics cached in `cache_dir`), or
    `"shapes"`/`"emoji"` (the world's real images of the same captions), measured with `fid_extractor`
    (`"inception"`, `"shapes"`, `"emoji"` or a module; default: the world's, else Inception). `image_dir` saves an
    imagefolder. `resume_dir` keeps finished batches and reuses those of an interrupted run of the same settings;
    Ctrl-C then raises `EvaluationInterrupted` with the partial report (`resume.remove_progress` deletes the folder).
    """
    processes = processes or Processes()
    if not captions:
        raise ValueError("Pass at least one caption to evaluate")
    if batch_size < 1:
        raise ValueError(f"The batch size must be positive; got {batch_size}")
    started = time.perf_counter()
    scoring = prepare_scoring(
        pipeline, captions, fid_reference, fid_extractor, clip_model, seed, processes, cache_dir, progress
    )
    sampler = dict(
        scheduler=type(pipeline.scheduler).__name__, num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale, batch_size=batch_size,
        dtype=str(pipeline.transformer.dtype).removeprefix("torch."), resolution=scoring.resolution,
    )  # fmt: skip
    model = str(pipeline.name_or_path or "(an unsaved pipeline)")
    header = dict(model=model, num_images=len(captions), seed=seed, sampler=sampler, num_processes=processes.count)
    image_dir = Path(image_dir) if image_dir is not None else None
    if image_dir is not None:
        image_dir.mkdir(parents=True, exist_ok=True)
    store = None
    if resume_dir is not None:
        extractor, clip = scoring.extractor, getattr(scoring.scorer, "model", None)
        settings = {  # what the kept batches depend on (`resume.SETTING_NAMES`)
            "captions": hashlib.sha256(json.dumps(captions).encode("utf-8")).hexdigest(),
            "num_images": len(captions),
            "seed": seed,
            **{key: sampler[key] for key in ("num_inference_steps", "guidance_scale", "batch_size", "resolution")},
            "pipeline": pipeline_digest(pipeline),
            "fid_extractor": extractor_name(extractor) if extractor is not None else None,
            "fid_extractor_weights": tensors_digest(extractor.state_dict()) if extractor is not None else None,
            "fid_renders": "renders" in scoring.feature_names,
            "clip_model": scoring.scorer.name if scoring.scorer is not None else None,
            "clip_weights": tensors_digest(clip.state_dict()) if clip is not None else None,
        }
        store = ProgressStore(resume_dir, settings, processes, image_dir)
        store.open()
    try:
        tally = sample_batches(pipeline, captions, scoring, processes, store, image_dir, header, progress, started)
    finally:
        if store is not None:
            store.close()  # another evaluation may take the folder now
    report = {**header, **scoring.report(tally, processes, captions)}
    report["seconds"] = round(time.perf_counter() - started + tally.resumed_seconds, 1)
    # The captioned grid of the first `GRID_SIZE` images, gathered from the processes that sampled them.
    resolution = scoring.resolution
    indices = torch.cat([rows[: len(grid), 0] for rows, grid in zip(tally.rows, tally.grid)] or [torch.zeros(0)])
    pixels = torch.cat([torch.zeros(0, resolution, resolution, 3, dtype=torch.uint8), *tally.grid])  # (n, H, W, 3)
    rows = processes.gather(torch.cat([indices.double()[:, None], pixels.flatten(1).double()], dim=1))
    rows = rows[rows[:, 0].argsort()]  # (n, 1 + H·W·3)
    cells = [Image.fromarray(row[1:].view(resolution, resolution, 3).to(torch.uint8).numpy()) for row in rows]
    grid = make_image_grid(cells, captions=[captions[int(i)] for i in rows[:, 0]])
    if image_dir is not None and processes.index == 0:
        with open(image_dir / "metadata.jsonl", "w", encoding="utf-8") as f:
            f.writelines(
                json.dumps({"file_name": f"{i:06d}.png", "text": text}) + "\n" for i, text in enumerate(captions)
            )
    return report, grid


def sample_batches(pipeline, captions, scoring, processes, store, image_dir, header, progress, started) -> Tally:
    """Sample and score this process's batches, taking those `store` holds; Ctrl-C with a store raises
    `EvaluationInterrupted` with a partial report (on the first process) over every batch on disk."""
    sampler = header["sampler"]
    batch_size = sampler["batch_size"]
    tally = Tally(scoring)
    bar = progress_bar(len(captions), "sampling", unit="img", disable=not progress or processes.index != 0)
    pipeline.set_progress_bar_config(disable=True)
    try:
        for batch in processes.batches(len(captions), batch_size):
            number = batch.start // batch_size
            paths = [image_dir / f"{index:06d}.png" for index in batch] if image_dir is not None else []
            result = store.read(number, batch, paths) if store is not None else None
            if result is None:
                batch_started = time.perf_counter()
                images = pipeline(
                    [captions[i] for i in batch],
                    num_inference_steps=sampler["num_inference_steps"],
                    guidance_scale=sampler["guidance_scale"],
                    generator=[torch.Generator().manual_seed(image_seed(scoring.seed, i)) for i in batch],
                ).images
                result = scoring.score(images, [captions[i] for i in batch], batch)
                for image, path in zip(images, paths):  # each written whole or not at all
                    write_durably(path, partial(image.save, format="PNG"))
                result.seconds = time.perf_counter() - batch_started
                if store is not None:
                    store.save(number, result)
            else:
                tally.resumed_seconds += result.seconds
            tally.add(result)
            bar.update(min(len(batch) * processes.count, bar.total - bar.n))  # the first process's pace, for all
    except KeyboardInterrupt as interruption:
        if store is None:
            raise
        report = None
        if processes.index == 0:
            kept = Tally(scoring)
            for result in store.results():
                kept.add(result)
            done = sum(len(rows) for rows in kept.rows)
            report = {**header, "partial": True, "num_images_done": done}
            if done >= 2 or (done and scoring.extractor is None):
                report.update(scoring.report(kept, Processes(device=processes.device), captions))
            report["seconds"] = round(time.perf_counter() - started + tally.resumed_seconds, 1)
        else:
            done = store.num_images_done()
        raise EvaluationInterrupted(store.folder, done, len(captions), report) from interruption
    finally:
        bar.close()
    return tally


def prepare_scoring(
    pipeline, captions, fid_reference, fid_extractor, clip_model, seed, processes, cache_dir, progress
) -> Scoring:
    """Load what scores the images (see `evaluate`), checking the arguments before any sampling."""
    resolution = pipeline.native_size
    world = world_of(captions)
    extractor = reference = reference_name = None
    num_features = 0
    if fid_reference is not None:
        world_reference = isinstance(fid_reference, str) and fid_reference in WORLDS
        if world_reference and (world is None or world.name != fid_reference):
            raise ValueError(
                f"The {fid_reference!r} FID reference needs {fid_reference}-world captions, but some captions are "
                f"not {fid_reference}-world captions (e.g. {WORLDS[fid_reference].example_captions[0]!r})"
            )
        if not world_reference and not isinstance(fid_reference, FIDStatistics) and not Path(fid_reference).exists():
            raise ValueError(f"FID reference {fid_reference}: no such file or folder; pass an .npz of mu/sigma, a "
                             "folder of real images, or a world's name (shapes, emoji)")  # fmt: skip
        extractor = load_extractor(fid_extractor or (fid_reference if world_reference else INCEPTION))
        extractor = extractor.to(processes.device)
        if not world_reference:
            reference = reference_statistics(
                fid_reference, extractor, resolution, processes=processes, cache_dir=cache_dir, progress=progress
            )
            reference_name = str(fid_reference) if not isinstance(fid_reference, FIDStatistics) else "FIDStatistics"
        num_features = feature_size(extractor, resolution)
    elif fid_extractor is not None:
        raise ValueError("A FID feature network was given without `fid_reference`: pass what FID compares with")
    scorer = (
        CLIPScorer.from_pretrained(clip_model, device=processes.device) if isinstance(clip_model, str) else clip_model
    )
    world_scorer = load(world.scorer)() if world is not None else None
    return Scoring(extractor, reference, reference_name, num_features, scorer, world, world_scorer, resolution, seed)
