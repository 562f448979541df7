"""The noise schedule every backbone here is trained on (SD's 1000-step `scaled_linear` betas, ε prediction), and the
diffusers schedulers that sample it right: discrete-time DDPM-family ones that neither clip nor threshold latents."""

import inspect
import math

import numpy as np
import torch
from diffusers import DPMSolverMultistepScheduler


# Stable Diffusion's noise schedule, as the papers (U-ViT's `stable_diffusion_beta_schedule`) and the trainer use it.
TRAINING_SCHEDULE = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
}

# Settings for other kinds of models, each of which samples ours wrongly; the default config turns each off, for
# schedulers built from it to inherit (DDIM's and DDPM's own default is clip_sample=True).
OTHER_MODELS_SETTINGS = {
    "clip_sample": "it clips the predicted clean sample to [-1, 1], for pixel-space models; latents go well beyond",
    "thresholding": "it thresholds the predicted clean sample, for pixel-space models; latents go well beyond [-1, 1]",
    "use_flow_sigmas": "it samples on the sigmas of flow-matching models; this backbone predicts a DDPM schedule's ε",
}


def default_scheduler() -> DPMSolverMultistepScheduler:
    """The papers' sampler: DPM-Solver++ (multistep order 2, close to the reference's single-step order 3) on the SD
    noise schedule, predicting ε, with every `OTHER_MODELS_SETTINGS` off in its config."""
    scheduler = DPMSolverMultistepScheduler(
        **TRAINING_SCHEDULE, algorithm_type="dpmsolver++", prediction_type="epsilon"
    )
    scheduler.register_to_config(**dict.fromkeys(OTHER_MODELS_SETTINGS, False))
    return scheduler


def schedule_differences(config) -> dict[str, object]:
    """The settings of a scheduler's config that give another noise schedule than the training one, with values."""
    different = {}
    if config.get("num_train_timesteps") != TRAINING_SCHEDULE["num_train_timesteps"]:
        different["num_train_timesteps"] = config.get("num_train_timesteps")
    trained_betas = config.get("trained_betas")
    if trained_betas is not None:  # diffusers then ignores beta_start, beta_end and beta_schedule
        betas = np.asarray(trained_betas, dtype=np.float64)
        start, end = TRAINING_SCHEDULE["beta_start"] ** 0.5, TRAINING_SCHEDULE["beta_end"] ** 0.5
        expected = np.linspace(start, end, TRAINING_SCHEDULE["num_train_timesteps"]) ** 2  # (1000,) scaled_linear
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
    """Refuse a scheduler that would silently sample an ε-prediction model of the training schedule wrongly."""
    name = type(scheduler).__name__
    takes = inspect.signature(type(scheduler).__init__).parameters  # settings of other classes may ride in a config
    rebuild = f"`pipe.scheduler = {name}.from_config(diffusers_lmlp.default_scheduler().config)`"
    if not isinstance(getattr(scheduler, "alphas_cumprod", None), torch.Tensor):  # flow-matching, EDM and VE have none
        raise ValueError(
            f"{name} cannot sample this pipeline: it samples on a schedule of its own (flow matching, EDM or VE), and "
            "the backbone predicts the ε of SD's DDPM schedule. Use a DDPM-family scheduler, e.g. "
            "`pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)`."
        )
    different = schedule_differences(scheduler.config)
    if different:
        given = ", ".join(f"{key}={value!r}" for key, value in different.items())
        raise ValueError(
            f"{name}'s noise schedule is not the one the backbone was trained on ({given}); build it with {rebuild}."
        )
    prediction_type = scheduler.config.get("prediction_type", "epsilon")
    if "prediction_type" in takes and prediction_type != "epsilon":
        raise ValueError(
            f"{name} has prediction_type={prediction_type!r}, but the backbone predicts ε; pass "
            f"prediction_type='epsilon', or build it with {rebuild}."
        )
    for setting, what in OTHER_MODELS_SETTINGS.items():
        if setting in takes and scheduler.config.get(setting):
            raise ValueError(
                f"{name} has {setting}=True: {what}, so the images come out wrong. Pass {setting}=False: "
                f"`pipe.scheduler = {name}.from_config(pipe.scheduler.config, {setting}=False)`."
            )
