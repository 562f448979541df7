"""The noise schedule every backbone of this package is trained on, and the diffusers schedulers that can sample it.

Every model here, trained by this package's trainer or converted from the papers' code, predicts the noise ε of
Stable Diffusion's 1000-step DDPM schedule (`scaled_linear` betas, 0.00085 → 0.012). A diffusers scheduler samples
it correctly when it:

- runs on that schedule: a discrete-time DDPM-family scheduler (DDIM, DDPM, PNDM, Euler, Heun, KDPM2, DPM-Solver,
  DEIS, UniPC, LCM, TCD, ...) whose config gives the training schedule's betas. Flow-matching, EDM and
  variance-exploding schedulers sample on schedules of their own, even where diffusers lists them as compatible;
- reads the network's output as ε (`prediction_type="epsilon"`);
- leaves the predicted clean latents as they are (`clip_sample` and `thresholding` are for pixel-space models, whose
  samples lie in [-1, 1]) and keeps to DDPM sigmas (`use_flow_sigmas` is for flow-matching models). Latents go
  beyond ±1 (13% of the shipped shapes model's final latents, up to 10.7): with DDIM's and DDPM's default,
  `clip_sample=True`, the shipped model drew 0 and 1 of 128 held-out captions right, against 128 and 127 with
  `clip_sample=False`; DPM-Solver++ with `use_flow_sigmas=True` drew 3 of 16 training captions right, against 16
  (docs/pipeline.md, "Schedulers").

`default_scheduler()` writes `clip_sample=False` into its config, as Stable Diffusion's scheduler configs do, so
`DDIMScheduler.from_config(pipe.scheduler.config)` and `DDIMScheduler.from_pretrained(folder, subfolder="scheduler")`
inherit it. `check_scheduler` refuses, before any model runs, a scheduler that would silently draw wrong images.
"""

import inspect
import math

import numpy as np
import torch
from diffusers import DPMSolverMultistepScheduler


# Stable Diffusion's noise schedule, which the papers (U-ViT's `stable_diffusion_beta_schedule`) and the trainer use.
TRAINING_SCHEDULE = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
}

# Scheduler settings for other kinds of models, each of which makes a scheduler sample this family wrongly. The
# default scheduler's config sets each one off, so that every scheduler built from it inherits that (DDIM's and
# DDPM's own default is clip_sample=True), as Stable Diffusion's scheduler configs do.
OTHER_MODELS_SETTINGS = {
    "clip_sample": "it clips the predicted clean sample to [-1, 1], for pixel-space models; latents go well beyond",
    "thresholding": "it thresholds the predicted clean sample, for pixel-space models; latents go well beyond [-1, 1]",
    "use_flow_sigmas": "it samples on the sigmas of flow-matching models; this backbone predicts a DDPM schedule's ε",
}


def default_scheduler() -> DPMSolverMultistepScheduler:
    """The papers' sampler: DPM-Solver++ on the Stable Diffusion noise schedule.

    `beta_schedule="scaled_linear"` from 0.00085 to 0.012 over 1000 training steps (the reference's
    "stable-diffusion" betas) with `algorithm_type="dpmsolver++"` (the reference's `predict_x0=True`) and
    ε-prediction. The reference runs a single-step order-3 solver on its own time grid; diffusers' multistep solver
    (order 2, recommended for guided sampling) is close but not bit-exact. Its config also turns off every setting of
    `OTHER_MODELS_SETTINGS` (`clip_sample=False` among them), which the schedulers built from it inherit.

    Returns:
        `DPMSolverMultistepScheduler`: A fresh scheduler; swap it with another DDPM-family diffusers scheduler built
        with `Scheduler.from_config(pipe.scheduler.config)` (`check_scheduler` says which work).
    """
    scheduler = DPMSolverMultistepScheduler(
        **TRAINING_SCHEDULE, algorithm_type="dpmsolver++", prediction_type="epsilon"
    )
    scheduler.register_to_config(**dict.fromkeys(OTHER_MODELS_SETTINGS, False))
    return scheduler


def schedule_differences(config) -> dict[str, object]:
    """The settings of a scheduler's config that give it another noise schedule than the training one.

    Read from the config, as every DDPM-family scheduler computes its betas from it, and not from the scheduler's
    tensors: those may live on the GPU, and the check must not wait for it.

    Args:
        config (`FrozenDict`): The scheduler's config.

    Returns:
        `dict[str, object]`: Each differing setting and its value (`trained_betas` as a count); empty when it is
        the training schedule.
    """
    different = {}
    if config.get("num_train_timesteps") != TRAINING_SCHEDULE["num_train_timesteps"]:
        different["num_train_timesteps"] = config.get("num_train_timesteps")
    trained_betas = config.get("trained_betas")
    if trained_betas is not None:  # diffusers then ignores beta_start, beta_end and beta_schedule
        betas = np.asarray(trained_betas, dtype=np.float64)
        # Stable Diffusion's scaled_linear betas: the squares of evenly spaced square roots.
        start, end = TRAINING_SCHEDULE["beta_start"] ** 0.5, TRAINING_SCHEDULE["beta_end"] ** 0.5
        expected = np.linspace(start, end, TRAINING_SCHEDULE["num_train_timesteps"]) ** 2  # (1000,)
        if betas.shape != expected.shape or not np.allclose(betas, expected, rtol=1e-4, atol=0.0):
            different["trained_betas"] = f"<{betas.size} values>"
    else:
        if config.get("beta_schedule") != TRAINING_SCHEDULE["beta_schedule"]:
            different["beta_schedule"] = config.get("beta_schedule")
        for key in ("beta_start", "beta_end"):
            value = config.get(key)
            if not (isinstance(value, float | int) and math.isclose(value, TRAINING_SCHEDULE[key], rel_tol=1e-6)):
                different[key] = value
    if config.get("rescale_betas_zero_snr"):
        different["rescale_betas_zero_snr"] = True
    return different


def check_scheduler(scheduler) -> None:
    """Refuse a scheduler that would sample an ε-prediction model of the training schedule wrongly, silently.

    Args:
        scheduler (`SchedulerMixin`): The pipeline's scheduler.

    Raises:
        `ValueError`: When it samples on another schedule (flow matching, EDM, other betas), reads the output as
            something other than ε, or clips or thresholds the predicted latents; the message says what to pass.
    """
    name = type(scheduler).__name__
    takes = inspect.signature(type(scheduler).__init__).parameters  # settings of other classes may ride in a config
    rebuild = f"`pipe.scheduler = {name}.from_config(diffusers_lmlp.default_scheduler().config)`"
    # DDPM-family schedulers hold the ᾱ_t of their schedule; flow-matching, EDM and VE ones do not.
    if not isinstance(getattr(scheduler, "alphas_cumprod", None), torch.Tensor):
        raise ValueError(
            f"{name} cannot sample this pipeline: its backbone predicts the noise ε of Stable Diffusion's 1000-step "
            f"DDPM schedule, and {name} samples on a schedule of its own (flow matching, EDM or variance-exploding "
            "sigmas). Use a DDPM-family scheduler built from the pipeline's config, for example "
            "`pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)` (DDIM, DDPM, PNDM, Euler, "
            "Euler ancestral, Heun, KDPM2, DPM-Solver, DEIS, UniPC, LCM and TCD work)."
        )
    different = schedule_differences(scheduler.config)
    if different:
        given = ", ".join(f"{key}={value!r}" for key, value in different.items())
        raise ValueError(
            f"{name}'s noise schedule is not the one the backbone was trained on ({given}; trained on Stable "
            f"Diffusion's betas, {TRAINING_SCHEDULE['beta_schedule']} from {TRAINING_SCHEDULE['beta_start']} to "
            f"{TRAINING_SCHEDULE['beta_end']} over {TRAINING_SCHEDULE['num_train_timesteps']} steps, unrescaled). "
            f"Build it with {rebuild}."
        )
    prediction_type = scheduler.config.get("prediction_type", "epsilon")
    if "prediction_type" in takes and prediction_type != "epsilon":
        raise ValueError(
            f"{name} has prediction_type={prediction_type!r}, but the backbone predicts the noise ε: the sampler "
            f"would read ε as another quantity and draw wrong images. Pass prediction_type='epsilon', or build it "
            f"with {rebuild}."
        )
    for setting, what in OTHER_MODELS_SETTINGS.items():
        if setting in takes and scheduler.config.get(setting):
            raise ValueError(
                f"{name} has {setting}=True: {what}, so the images come out wrong. Pass {setting}=False: "
                f"`pipe.scheduler = {name}.from_config(pipe.scheduler.config, {setting}=False)`."
            )
