"""Sampling and scoring during training (the validation grid, FID and world scores) and the final evaluation on the
world, with the plain backbone, its EMA weights and the default scheduler: what a user gets.
"""

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
def generate(pipe: LMLPPipeline, prompts: list[str], args) -> list[Image.Image]:
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompts, num_inference_steps=args.validation_inference_steps, guidance_scale=args.validation_guidance_scale,
        generator=torch.Generator().manual_seed(args.seed)
    ).images  # fmt: skip


def default_validation_prompts(args) -> list[str]:
    """`--validation_prompts`, else an embedded world's validation prompts, else none."""
    if args.validation_prompts:
        return args.validation_prompts
    return load(WORLDS[args.world].validation_prompts)() if args.world else []


def validation_inputs(args) -> tuple[list[str], list[str]]:
    """The grid's prompts and the captions FID samples; says so when there are neither."""
    prompts, fid_captions = default_validation_prompts(args), []
    if args.validation_fid_images:
        source = args.validation_fid_captions or WORLDS[args.world].splits["train"]
        fid_captions = draw_captions(source, args.validation_fid_images, args.seed)
    if not (prompts or fid_captions):
        logger.info(
            "no validation during training and no sample grid at the end: your data has no validation prompts (pass "
            "--validation_prompts or --validation_prompts_file to see samples every --validation_steps)"
        )
    return prompts, fid_captions


def validate(accelerator, pipe: LMLPPipeline, ema, args, prompts, fid_captions, *, step: int, seconds: float):
    """Sample `prompts` with the EMA weights into `validation/step-<step>.png` and the trackers; log the FID of
    `fid_captions`, and a world's scores to `<logging_dir>/scores.jsonl` (`seconds`: the training time so far)."""
    output_dir, model = Path(args.output_dir), pipe.transformer
    model.eval()
    if ema is not None:
        ema.store(model.parameters())
        ema.copy_to(model.parameters())
    try:
        if args.world:
            reports = evaluate_splits(pipe, args, final=False)
            record = {"step": step, "minutes": round(seconds / 60, 3)}
            for split, report in reports.items():
                record[split] = report[args.world]
                accelerator.log({f"scores/{split}/{k}": v for k, v in report[args.world].items()}, step=step)
            path = output_dir / args.logging_dir / SCORES_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            scores = (f"{split} " + ", ".join(f"{k} {v:.0%}" for k, v in record[split].items()) for split in reports)
            logger.info(f"step {step}: " + "; ".join(scores))
        images = generate(pipe, prompts, args) if prompts else []
        if fid_captions:
            report, _ = evaluate(
                pipe, fid_captions, fid_reference=args.validation_fid_reference or args.world,
                num_inference_steps=args.validation_inference_steps, guidance_scale=args.validation_guidance_scale,
                seed=args.seed, progress=False
            )  # fmt: skip
            accelerator.log({"fid": report["fid"]}, step=step)
            logger.info(
                f"step {step}: FID {report['fid']:.3f} ({len(fid_captions)} images, {report['fid_extractor']})"
            )
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
            tracker.writer.add_images(
                "validation", np.stack([np.asarray(i) for i in images]), step, dataformats="NHWC"
            )
        elif tracker.name == "wandb":
            import wandb

            tracker.log({"validation": [wandb.Image(i, caption=p) for i, p in zip(images, prompts)]}, step=step)
    logger.info(f"validation grid: {path}")


def keep_scores_until(path: Path, step: int) -> None:
    """Keep the scores in `path` that a run starting at `step` continues: none for a new run, those up to `step`
    for a resumed one."""
    if path.is_file():
        kept = [
            line
            for line in path.read_text(encoding="utf-8").splitlines()
            if step and line and json.loads(line)["step"] <= step
        ]
        path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def evaluate_splits(pipe: LMLPPipeline, args, final: bool) -> dict[str, dict]:
    """The report of each split of the world: at the validation sampler settings, or (`final`) at the pipeline's
    defaults with more captions, FID and CLIP score."""
    world = WORLDS[args.world]
    if final:
        seeds, num_captions = world.final_seeds, world.num_captions
        clip_model = load(world.clip_model) if world.clip_model else None
        if isinstance(clip_model, (str, Path)):  # loaded once for every split
            from diffusers_lmlp.evaluation import CLIPScorer

            clip_model = CLIPScorer.from_pretrained(clip_model)
        settings = dict(
            num_inference_steps=args.final_evaluation_inference_steps, fid_reference=world.name, clip_model=clip_model
        )
    else:
        seeds, num_captions = dict.fromkeys(world.splits, 1), world.validation_captions
        settings = dict(
            num_inference_steps=args.validation_inference_steps,
            guidance_scale=args.validation_guidance_scale,
            progress=False,
        )
    return {
        split: evaluate(
            pipe,
            draw_captions(source, num_captions, args.seed) * seeds[split],
            batch_size=64,
            seed=args.seed,
            **settings,
        )[0]
        for split, source in world.splits.items()
    }


def score_summary(reports: dict[str, dict], world: str, suffix: str = "") -> dict[str, dict]:
    """The summary's entries of one final evaluation, by split, under keys ending with `suffix` (`"_before"`: a LoRA
    run's base model)."""
    summary = {
        f"scores{suffix}": {split: report[world] for split, report in reports.items()},
        f"score_intervals{suffix}": {split: report[f"{world}_intervals"] for split, report in reports.items()},
        f"{world}_fid{suffix}": {
            split: {key: report[key] for key in ("fid", "fid_floor", "num_images")}
            for split, report in reports.items()
        },
    }
    if all("clip_score" in report for report in reports.values()):
        summary[f"clip_score{suffix}"] = {split: report["clip_score"] for split, report in reports.items()}
    return summary
