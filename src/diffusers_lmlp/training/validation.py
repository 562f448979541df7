"""Sampling and scoring the model being trained: the validation grid (and FID, and on the shapes world the scores of
the learning curves) every `--validation_steps`, and the final evaluation of the finished pipeline on the shapes
world.

The samples use the plain backbone (`training.compilation.plain_backbone`) with the EMA weights swapped in, and the
package's default scheduler: what `LMLPPipeline` gives a user.
"""

import contextlib
import json
from pathlib import Path

import numpy as np
import torch
from accelerate.logging import get_logger
from diffusers.training_utils import EMAModel
from PIL import Image

from diffusers_lmlp import LMLPPipeline, default_scheduler
from diffusers_lmlp.evaluation import draw_captions, evaluate
from diffusers_lmlp.image_grid import make_image_grid
from diffusers_lmlp.training.compilation import plain_backbone


logger = get_logger(__name__)

# Images per caption (each from its own noise seed) in the final shapes evaluation: the intervals resample captions,
# so more seeds of the 32 held-out combinations narrow them.
FINAL_EVALUATION_SEEDS = {"train": 3, "held-out": 4}
# The shapes world's splits the scorer reads, and the captions of each (`draw_captions` sources).
SCORED_SPLITS = {"train": "shapes:train", "held-out": "shapes:heldout"}
# Where each validation of a shapes-world run appends its scores, inside the logging folder: the learning curves.
SCORES_FILE = "scores.jsonl"


@torch.no_grad()
def generate(pipe: LMLPPipeline, prompts: list[str], args, seed: int) -> list[Image.Image]:
    generator = torch.Generator().manual_seed(seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompts,
        num_inference_steps=args.validation_inference_steps,
        guidance_scale=args.validation_guidance_scale,
        generator=generator,
    ).images


def build_pipeline(model, tokenizer, text_encoder, vae) -> LMLPPipeline:
    return LMLPPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=model, scheduler=default_scheduler()
    )


def default_validation_prompts(args) -> list[str]:
    """The validation grid's prompts: `--validation_prompts` (or the file's), else on the shapes world 6 training
    captions and 2 held-out combinations, else none (no validation during training, no sample grid at the end).

    Args:
        args (`argparse.Namespace`): The parsed arguments.
    """
    if args.validation_prompts:
        return args.validation_prompts
    if args.shapes_world:
        from diffusers_lmlp.shapes.world import held_out_specs, train_specs

        return [s.caption for s in train_specs()[:: max(1, len(train_specs()) // 6)][:6]] + [
            s.caption for s in held_out_specs()[:2]
        ]
    return []


def validation_inputs(args) -> tuple[list[str], list[str]]:
    """What each validation samples: the grid's prompts (`default_validation_prompts`) and the captions FID samples
    (`--validation_fid_images` of `--validation_fid_captions`); a run with neither is told so.

    Args:
        args (`argparse.Namespace`): The parsed arguments.
    """
    prompts = default_validation_prompts(args)
    fid_captions = (
        draw_captions(args.validation_fid_captions or "shapes:train", args.validation_fid_images, args.seed)
        if args.validation_fid_images
        else []
    )
    if not (prompts or fid_captions):
        logger.info(
            "no validation during training and no sample grid at the end: your data has no validation prompts (pass "
            "--validation_prompts or --validation_prompts_file to see samples every --validation_steps)"
        )
    return prompts, fid_captions


@contextlib.contextmanager
def ema_weights(model, ema: EMAModel | None):
    """Temporarily swap the EMA weights into the model."""
    if ema is None:
        yield
        return
    ema.store(model.parameters())
    ema.copy_to(model.parameters())
    try:
        yield
    finally:
        ema.restore(model.parameters())


def validate(
    accelerator,
    model,
    ema,
    tokenizer,
    text_encoder,
    vae,
    prompts,
    fid_captions,
    args,
    output_dir: Path,
    step: int,
    seconds: float,
):
    """Sample the prompts (EMA weights if any) and save `validation/step-<step>.png`, a grid captioned with them;
    log the samples to tensorboard (one tiled image, tag "validation") and wandb (one image per prompt, captioned).
    With `--validation_fid_images`, also sample the FID captions and log their FID ("fid"). On the shapes world, also
    score one image of every held-out combination and of as many training captions (`log_scores`).

    Args:
        accelerator (`Accelerator`): The run's accelerator; its trackers receive the images.
        model: The prepared backbone.
        ema (`EMAModel`, *optional*): The EMA weights, swapped in for sampling.
        tokenizer, text_encoder, vae: The frozen components.
        prompts (`list[str]`): The validation prompts (none: no grid).
        fid_captions (`list[str]`): The captions FID samples (none: no FID).
        args (`argparse.Namespace`): The parsed arguments (seed, sampling steps, guidance scale, FID reference).
        output_dir (`Path`): The `--output_dir`.
        step (`int`): The optimizer step, the images' step in the trackers.
        seconds (`float`): The time since the run started (over every segment of a resumed run).
    """
    unwrapped = plain_backbone(accelerator, model)  # sampled uncompiled: no recompilation for the sampler's batches
    unwrapped.eval()
    pipe = build_pipeline(unwrapped, tokenizer, text_encoder, vae)
    with ema_weights(unwrapped, ema):
        if args.shapes_world:
            log_scores(accelerator, pipe, args, output_dir, step, seconds)
        images = generate(pipe, prompts, args, seed=args.seed) if prompts else []
        if fid_captions:
            report, _ = evaluate(
                pipe,
                fid_captions,
                fid_reference=args.validation_fid_reference or "shapes",
                num_inference_steps=args.validation_inference_steps,
                guidance_scale=args.validation_guidance_scale,
                seed=args.seed,
                progress=False,
            )
            accelerator.log({"fid": report["fid"]}, step=step)
            logger.info(
                f"step {step}: FID {report['fid']:.3f} ({len(fid_captions)} images, {report['fid_extractor']})"
            )
    unwrapped.train()
    if not prompts:
        return
    grid = make_image_grid(images, captions=prompts)
    path = output_dir / "validation" / f"step-{step:07d}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
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
    """Keep the scores that a run starting at `step` continues: none for a new run (an overwritten run's are removed),
    those up to `step` for a resumed one (the later ones were scored by weights that the resumed run trains again).

    Args:
        path (`Path`): The run's `scores.jsonl`.
        step (`int`): The step the run starts from.
    """
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if step and line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def log_scores(accelerator, pipe: LMLPPipeline, args, output_dir: Path, step: int, seconds: float) -> None:
    """Score the shapes model being trained: one image of each held-out combination and of as many training
    captions, at the validation sampler settings; log the accuracies to the trackers (`scores/<split>/<attribute>`)
    and append them, with the step and the minutes since the run started, to `<logging_dir>/scores.jsonl`, the
    learning curves that `benchmarks/learning_curves.py` plots.

    Args:
        accelerator (`Accelerator`): The run's accelerator (its trackers).
        pipe (`LMLPPipeline`): The pipeline of the model's current (EMA) weights.
        args (`argparse.Namespace`): The parsed arguments (the seed, the validation sampler settings).
        output_dir (`Path`): The `--output_dir`.
        step (`int`): The optimizer step.
        seconds (`float`): The time since the run started.
    """
    reports = evaluate_splits(
        pipe,
        args,
        dict.fromkeys(SCORED_SPLITS, 1),
        args.validation_inference_steps,
        guidance_scale=args.validation_guidance_scale,
        progress=False,
    )
    record = {"step": step, "minutes": round(seconds / 60, 3)}
    for split, report in reports.items():
        record[split] = report["shapes"]
        accelerator.log({f"scores/{split}/{name}": value for name, value in report["shapes"].items()}, step=step)
    path = output_dir / args.logging_dir / SCORES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    held_out, train = record["held-out"], record["train"]
    logger.info(
        f"step {step}: held-out shape {held_out['shape']:.0%}, all {held_out['all']:.0%}; train all {train['all']:.0%}"
    )


def final_evaluation(pipe: LMLPPipeline, args) -> dict[str, dict]:
    """Evaluate the finished pipeline on the shapes world at the pipeline's default sampler settings (what a user
    gets from `pipe(caption)`; `--final_evaluation_inference_steps` changes the steps, for smoke runs): the shapes
    scorer's accuracies with 95% intervals over captions, and shapes-FID against renders of the same captions with its
    real-vs-real floor, each caption sampled `FINAL_EVALUATION_SEEDS` times.

    Args:
        pipe (`LMLPPipeline`): The trained pipeline.
        args (`argparse.Namespace`): The parsed arguments (the seed, the sampler steps).

    Returns:
        `dict[str, dict]`: The evaluation report of each split ("train", "held-out").
    """
    return evaluate_splits(
        pipe, args, FINAL_EVALUATION_SEEDS, args.final_evaluation_inference_steps, fid_reference="shapes"
    )


def evaluate_splits(
    pipe: LMLPPipeline,
    args,
    seeds: dict[str, int],
    num_inference_steps: int,
    guidance_scale: float | None = None,
    fid_reference: str | None = None,
    progress: bool = True,
) -> dict[str, dict]:
    """Sample and score the shapes model on each of `SCORED_SPLITS`: as many captions as there are held-out
    combinations (all of them, for the held-out split), each `seeds[split]` times.

    Args:
        pipe (`LMLPPipeline`): The pipeline.
        args (`argparse.Namespace`): The parsed arguments (the seed).
        seeds (`dict[str, int]`): Images per caption, by split.
        num_inference_steps (`int`): Sampler steps.
        guidance_scale (`float`, *optional*): The guidance; the pipeline's default when not given.
        fid_reference (`str`, *optional*): `"shapes"` for shapes-FID against renders of the captions; none without.
        progress (`bool`, *optional*, defaults to `True`): Show the sampling's progress.

    Returns:
        `dict[str, dict]`: The evaluation report of each split ("train", "held-out").
    """
    from diffusers_lmlp.shapes.world import held_out_specs

    sampler = {} if guidance_scale is None else {"guidance_scale": guidance_scale}
    return {
        split: evaluate(
            pipe,
            draw_captions(source, len(held_out_specs()), args.seed) * seeds[split],
            fid_reference=fid_reference,
            num_inference_steps=num_inference_steps,
            batch_size=64,
            seed=args.seed,
            progress=progress,
            **sampler,
        )[0]
        for split, source in SCORED_SPLITS.items()
    }


def score_summary(reports: dict[str, dict], suffix: str = "") -> dict[str, dict]:
    """The summary's entries for one final evaluation: the scorer's accuracies, their intervals and shapes-FID, each
    by split, under keys ending with `suffix` (`"_before"` for the base model of a LoRA run).

    Args:
        reports (`dict[str, dict]`): `final_evaluation`'s reports, by split.
        suffix (`str`, *optional*, defaults to `""`): Appended to each key.
    """
    return {
        f"scores{suffix}": {split: report["shapes"] for split, report in reports.items()},
        f"score_intervals{suffix}": {split: report["shapes_intervals"] for split, report in reports.items()},
        f"shapes_fid{suffix}": {
            split: {key: report[key] for key in ("fid", "fid_floor", "num_images")}
            for split, report in reports.items()
        },
    }
