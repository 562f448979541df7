"""Sampling and scoring during training and the final evaluation, with the EMA weights and the default scheduler."""

import json
from pathlib import Path

import numpy as np
import torch
from accelerate.logging import get_logger
from PIL import Image

from diffusers_lmlp import LMLPPipeline
from diffusers_lmlp.evaluation import draw_captions, evaluate
from diffusers_lmlp.image_grid import make_image_grid
from diffusers_lmlp.worlds import WORLDS, load


logger = get_logger(__name__)

SCORES_FILE = "scores.jsonl"  # in the logging folder, appended to by each validation of a world's run


@torch.no_grad()
def generate(pipe: LMLPPipeline, prompts: list[str], *, seed: int, **sampling) -> list[Image.Image]:
    """`prompts` sampled with the pipeline's `sampling` keywords (`num_inference_steps`, `guidance_scale`)."""
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompts, generator=torch.Generator().manual_seed(seed), **sampling).images


def validation_inputs(
    prompts: list[str] | None, *, world: str | None, fid_images: int, fid_captions: str | None, seed: int
) -> tuple[list[str], list[str]]:
    """The grid's prompts (`prompts`, else an embedded world's) and the captions FID samples; says so when neither."""
    prompts = prompts or (load(WORLDS[world].validation_prompts)() if world else [])
    drawn = draw_captions(fid_captions or WORLDS[world].splits["train"], fid_images, seed) if fid_images else []
    if not (prompts or drawn):
        fix = "pass --validation_prompts or --validation_prompts_file to see samples every --validation_steps"
        logger.info(f"no validation during training and no sample grid at the end: your data has none ({fix})")
    return prompts, drawn


def validate(
    accelerator, pipe: LMLPPipeline, ema, prompts: list[str], fid_captions: list[str], *, step: int, seconds: float,
    output_dir: Path, logging_dir: str, world: str | None, fid_reference: str | None, num_inference_steps: int,
    guidance_scale: float, seed: int,
) -> None:  # fmt: skip
    """Sample `prompts` with the EMA weights into `validation/step-<step>.png` and the trackers; log the FID of
    `fid_captions` against `fid_reference` (or the world's), and a world's scores to `<logging_dir>/scores.jsonl`."""
    sampling = dict(num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, seed=seed)
    model = pipe.transformer
    model.eval()
    if ema is not None:
        ema.store(model.parameters())
        ema.copy_to(model.parameters())
    try:
        if world:
            reports = evaluate_splits(pipe, world, **sampling)
            record = {"step": step, "minutes": round(seconds / 60, 3)}
            for split, report in reports.items():
                record[split] = report[world]
                accelerator.log({f"scores/{split}/{k}": v for k, v in report[world].items()}, step=step)
            path = output_dir / logging_dir / SCORES_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            scores = (f"{split} " + ", ".join(f"{k} {v:.0%}" for k, v in record[split].items()) for split in reports)
            logger.info(f"step {step}: " + "; ".join(scores))
        images = generate(pipe, prompts, **sampling) if prompts else []
        if fid_captions:
            report, _ = evaluate(pipe, fid_captions, fid_reference=fid_reference or world, progress=False, **sampling)
            accelerator.log({"fid": report["fid"]}, step=step)
            how = f"{len(fid_captions)} images, {report['fid_extractor']}"
            logger.info(f"step {step}: FID {report['fid']:.3f} ({how})")
    finally:
        if ema is not None:
            ema.restore(model.parameters())
        model.train()
    if not prompts:
        return
    path = output_dir / "validation" / f"step-{step:07d}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    make_image_grid(images, captions=prompts).save(path)
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.log_images({"validation": np.stack([np.asarray(i) for i in images])}, step, dataformats="NHWC")
        elif tracker.name == "wandb":
            import wandb

            tracker.log({"validation": [wandb.Image(i, caption=p) for i, p in zip(images, prompts)]}, step=step)
    logger.info(f"validation grid: {path}")


def keep_scores_until(path: Path, step: int) -> None:
    """Keep the scores in `path` that a run starting at `step` continues: none for a new run."""
    if path.is_file():
        lines = path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if step and line and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def evaluate_splits(
    pipe: LMLPPipeline, world: str, *, num_inference_steps: int, seed: int, guidance_scale: float | None = None,
    final: bool = False,
) -> dict[str, dict]:  # fmt: skip
    """Each split's report on the `world`: at the validation settings, or `final` (more captions, FID, CLIP score)."""
    world = WORLDS[world]
    if final:
        seeds, num_captions = world.final_seeds, world.num_captions
        clip_model = load(world.clip_model) if world.clip_model else None
        if isinstance(clip_model, (str, Path)):  # loaded once for every split
            from diffusers_lmlp.evaluation import CLIPScorer

            clip_model = CLIPScorer.from_pretrained(clip_model)
        settings = dict(fid_reference=world.name, clip_model=clip_model)
    else:
        seeds, num_captions = dict.fromkeys(world.splits, 1), world.validation_captions
        settings = dict(guidance_scale=guidance_scale, progress=False)
    return {
        split: evaluate(
            pipe, draw_captions(source, num_captions, seed) * seeds[split], batch_size=64, seed=seed,
            num_inference_steps=num_inference_steps, **settings,
        )[0]
        for split, source in world.splits.items()
    }  # fmt: skip


def score_summary(reports: dict[str, dict], world: str, suffix: str = "") -> dict[str, dict]:
    """The summary's entries of one final evaluation, by split, under keys ending with `suffix`."""
    summary = {
        f"scores{suffix}": {split: report[world] for split, report in reports.items()},
        f"score_intervals{suffix}": {split: report[f"{world}_intervals"] for split, report in reports.items()},
        f"{world}_fid{suffix}": {s: {k: r[k] for k in ("fid", "fid_floor", "num_images")} for s, r in reports.items()},
    }
    if all("clip_score" in report for report in reports.values()):
        summary[f"clip_score{suffix}"] = {split: report["clip_score"] for split, report in reports.items()}
    return summary
