"""Every DDPM-family scheduler built the documented way draws the caption; a wrong one is refused with its fix."""

import diffusers
import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler
from space_server import one_cpu_thread, shapes_pipeline

from diffusers_lmlp import LMLPPipeline, default_scheduler
from diffusers_lmlp.evaluation.captions import draw_captions
from diffusers_lmlp.pipelines import pipeline_lmlp
from diffusers_lmlp.shapes.scorer import score_images


# Each DDPM-family scheduler importable without extras (LMS: scipy, SDE: torchsde), with its steps (DDPM's need more).
DDPM_FAMILY = {DDPMScheduler: 50} | dict.fromkeys(
    [getattr(diffusers, f"{name}Scheduler") for name in (
        "DDIM", "DEISMultistep", "DPMSolverMultistep", "DPMSolverSinglestep", "EulerAncestralDiscrete",
        "EulerDiscrete", "HeunDiscrete", "KDPM2AncestralDiscrete", "KDPM2Discrete", "LCM", "PNDM", "TCD",
        "UniPCMultistep",
    )], 10,
)  # fmt: skip
CONFIG = default_scheduler().config


@pytest.fixture(scope="module")
def shapes_pipe():
    with one_cpu_thread():  # the model is far too small to gain from a second thread
        yield shapes_pipeline()


def score(pipe: LMLPPipeline, split: str, steps: int = 10, scheduler=None) -> float:
    """The shapes scorer's share of 8 captions of `split` drawn right by `pipe` (with `scheduler`, if given)."""
    if scheduler is not None:
        pipe = LMLPPipeline.from_pipe(pipe, scheduler=scheduler)
        pipe.set_progress_bar_config(disable=True)
    captions = draw_captions(split, 8, seed=3)
    images = pipe(captions, num_inference_steps=steps, generator=torch.Generator().manual_seed(0)).images
    return score_images(images, captions)["all"]


def test_the_default_and_saved_configs_leave_latents_unclipped(shapes_pipe, tmp_path, monkeypatch):
    # DDIM and DDPM clip the predicted sample by default: built from the pipeline's config, they must not.
    assert CONFIG.clip_sample is False and DDIMScheduler().config.clip_sample is True
    assert [s.from_config(CONFIG).config.clip_sample for s in (DDIMScheduler, DDPMScheduler)] == [False, False]
    # diffusers' other idiom, `Scheduler.from_pretrained(folder, subfolder="scheduler")`, reads the saved config.
    shapes_pipe.save_pretrained(tmp_path)
    ddim = DDIMScheduler.from_pretrained(tmp_path, subfolder="scheduler")
    assert ddim.config.clip_sample is False
    pipe = LMLPPipeline.from_pretrained(tmp_path, scheduler=ddim)
    pipe.set_progress_bar_config(disable=True)
    assert score(pipe, "shapes:heldout") >= 7 / 8
    # The schedule is what counts, however it is given: the training betas listed out draw the captions too.
    listed = DDIMScheduler(trained_betas=default_scheduler().betas.tolist(), clip_sample=False)
    assert score(shapes_pipe, "shapes:train", scheduler=listed) >= 7 / 8
    # Clipping is what ruins the images, not a matter of taste: with `clip_sample=True`, DDIM draws no caption right.
    scheduler = DDIMScheduler.from_config(shapes_pipe.scheduler.config, clip_sample=True)
    with pytest.raises(ValueError, match="clip_sample=True"):
        score(shapes_pipe, "shapes:train", scheduler=scheduler)
    monkeypatch.setattr(pipeline_lmlp, "check_scheduler", lambda scheduler: None)  # what it would return unchecked
    assert score(shapes_pipe, "shapes:train", scheduler=scheduler) <= 1 / 8


@pytest.mark.parametrize("scheduler_class", list(DDPM_FAMILY), ids=lambda c: c.__name__)
def test_every_ddpm_family_scheduler_draws_the_caption(shapes_pipe, scheduler_class):
    # The documented swap, `Scheduler.from_config(pipe.scheduler.config)`, samples the shipped model right.
    scheduler = scheduler_class.from_config(shapes_pipe.scheduler.config)
    assert score(shapes_pipe, "shapes:train", DDPM_FAMILY[scheduler_class], scheduler) >= 7 / 8


DDIM, EULER = DDIMScheduler.from_config, EulerDiscreteScheduler.from_config
# fmt: off
BAD_SCHEDULERS = {
    "DDIM clip_sample=True": (lambda: DDIM(CONFIG, clip_sample=True), "clip_sample=False"),
    "DDPM thresholding": (lambda: DDPMScheduler.from_config(CONFIG, thresholding=True), "thresholding=False"),
    "flow sigmas": (lambda: DPMSolverMultistepScheduler.from_config(CONFIG, use_flow_sigmas=True), "use_flow_sigmas="),
    "v-prediction": (lambda: DPMSolverMultistepScheduler.from_config(CONFIG, prediction_type="v_prediction"), "'v_pr"),
    "x0-prediction": (lambda: EULER(CONFIG, prediction_type="sample"), "prediction_type="),
    "DDIM's own betas": (lambda: DDIMScheduler(clip_sample=False), "beta_schedule='linear'"),
    "zero terminal SNR": (lambda: DDIM(CONFIG, rescale_betas_zero_snr=True), "rescale_betas_zero_snr=True"),
    "2000 training steps": (lambda: DDIM(CONFIG, num_train_timesteps=2000), "timesteps=2000"),
    "other trained betas": (lambda: DDIM(CONFIG, trained_betas=[0.01] * 1000), "trained_betas='<1000 values>'"),
    "flow matching": (diffusers.FlowMatchEulerDiscreteScheduler, "schedule of its own"),
    "EDM": (diffusers.EDMEulerScheduler, "schedule of its own"),
}
# fmt: on


@pytest.mark.parametrize("case", BAD_SCHEDULERS)
def test_a_scheduler_that_would_draw_wrong_images_is_refused_before_any_model_runs(pipe, record_batches, case):
    make_scheduler, fix = BAD_SCHEDULERS[case]
    pipe.scheduler = make_scheduler()
    calls = record_batches(pipe.transformer, pipe.text_encoder)
    with pytest.raises(ValueError) as error:
        pipe("a red circle", num_inference_steps=3)
    assert type(pipe.scheduler).__name__ in str(error.value) and fix in str(error.value) and calls == []
