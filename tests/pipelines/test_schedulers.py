"""Which diffusers schedulers sample the pipeline: every DDPM-family one built the documented way draws the caption, and
one that would silently draw wrong images (clipping the latents, another prediction type, another noise schedule,
flow matching or EDM) is refused with its fix before any model runs."""

import json

import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DDPMScheduler,
    DEISMultistepScheduler,
    DPMSolverMultistepScheduler,
    DPMSolverSinglestepScheduler,
    EDMEulerScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    HeunDiscreteScheduler,
    KDPM2AncestralDiscreteScheduler,
    KDPM2DiscreteScheduler,
    LCMScheduler,
    PNDMScheduler,
    TCDScheduler,
    UniPCMultistepScheduler,
)

from diffusers_lmlp import LMLPPipeline, default_scheduler
from diffusers_lmlp.evaluation.captions import draw_captions
from diffusers_lmlp.pipelines import pipeline_lmlp
from diffusers_lmlp.shapes import pretrained_shapes_pipeline
from diffusers_lmlp.shapes.scorer import score_images
from diffusers_lmlp.tiny import build_tiny_pipeline


# Every DDPM-family scheduler of diffusers that imports without optional packages (LMS needs scipy, DPM-Solver SDE
# torchsde), with the steps it samples the shapes model in; DDPM's ancestral steps need more.
DDPM_FAMILY = {
    DDIMScheduler: 25,
    DDPMScheduler: 100,
    DEISMultistepScheduler: 25,
    DPMSolverMultistepScheduler: 25,
    DPMSolverSinglestepScheduler: 25,
    EulerAncestralDiscreteScheduler: 25,
    EulerDiscreteScheduler: 25,
    HeunDiscreteScheduler: 25,
    KDPM2AncestralDiscreteScheduler: 25,
    KDPM2DiscreteScheduler: 25,
    LCMScheduler: 25,
    PNDMScheduler: 25,
    TCDScheduler: 25,
    UniPCMultistepScheduler: 25,
}


@pytest.fixture(scope="module")
def shapes_pipe():
    pipe = pretrained_shapes_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def tiny_pipe():
    pipe = build_tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_the_default_config_carries_what_a_latent_model_needs():
    """DDIM and DDPM clip the predicted sample by default: built from the pipeline's config, they must not."""
    config = default_scheduler().config
    assert config.clip_sample is False
    assert DDIMScheduler.from_config(config).config.clip_sample is False
    assert DDPMScheduler.from_config(config).config.clip_sample is False
    assert DDIMScheduler().config.clip_sample is True  # what the config guards against


@pytest.mark.parametrize("scheduler_class", list(DDPM_FAMILY), ids=lambda c: c.__name__)
def test_every_ddpm_family_scheduler_draws_the_caption(shapes_pipe, scheduler_class):
    """The documented swap, `Scheduler.from_config(pipe.scheduler.config)`, samples the shipped model right."""
    pipe = LMLPPipeline.from_pipe(shapes_pipe, scheduler=scheduler_class.from_config(shapes_pipe.scheduler.config))
    pipe.set_progress_bar_config(disable=True)
    assert isinstance(pipe.scheduler, scheduler_class)
    captions = draw_captions("shapes:train", 8, seed=3)
    images = pipe(
        captions, num_inference_steps=DDPM_FAMILY[scheduler_class], generator=torch.Generator().manual_seed(0)
    ).images
    assert score_images(images, captions)["all"] >= 7 / 8


def test_a_scheduler_loaded_from_the_shipped_folder_keeps_the_latents_unclipped(shapes_pipe, tmp_path):
    """diffusers' other idiom, `Scheduler.from_pretrained(folder, subfolder="scheduler")`, reads the saved config."""
    shapes_pipe.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "scheduler" / "scheduler_config.json").read_text())["clip_sample"] is False
    ddim = DDIMScheduler.from_pretrained(tmp_path, subfolder="scheduler")
    assert ddim.config.clip_sample is False
    pipe = LMLPPipeline.from_pretrained(tmp_path, scheduler=ddim)
    pipe.set_progress_bar_config(disable=True)
    captions = draw_captions("shapes:heldout", 8, seed=3)
    images = pipe(captions, num_inference_steps=25, generator=torch.Generator().manual_seed(0)).images
    assert score_images(images, captions)["all"] >= 7 / 8


def test_clipping_is_what_ruins_the_images(shapes_pipe, monkeypatch):
    """The refusal is not a matter of taste: with `clip_sample=True`, DDIM draws no caption right."""
    pipe = LMLPPipeline.from_pipe(
        shapes_pipe, scheduler=DDIMScheduler.from_config(shapes_pipe.scheduler.config, clip_sample=True)
    )
    pipe.set_progress_bar_config(disable=True)
    captions = draw_captions("shapes:train", 8, seed=3)
    with pytest.raises(ValueError, match="clip_sample=True"):
        pipe(captions, num_inference_steps=25)
    # What the pipeline would have returned without the check.
    monkeypatch.setattr(pipeline_lmlp, "check_scheduler", lambda scheduler: None)
    images = pipe(captions, num_inference_steps=25, generator=torch.Generator().manual_seed(0)).images
    assert score_images(images, captions)["all"] <= 1 / 8


def _bad_schedulers():
    config = default_scheduler().config
    return {
        "DDIM clip_sample=True": (DDIMScheduler.from_config(config, clip_sample=True), "clip_sample=False"),
        "DDPM thresholding": (DDPMScheduler.from_config(config, thresholding=True), "thresholding=False"),
        "flow-matching sigmas": (
            DPMSolverMultistepScheduler.from_config(config, use_flow_sigmas=True),
            "use_flow_sigmas=False",
        ),
        "v-prediction": (
            DPMSolverMultistepScheduler.from_config(config, prediction_type="v_prediction"),
            "prediction_type='v_prediction'",
        ),
        "x0-prediction": (EulerDiscreteScheduler.from_config(config, prediction_type="sample"), "prediction_type="),
        "DDIM's own betas": (DDIMScheduler(clip_sample=False), "beta_schedule='linear'"),
        "zero terminal SNR": (
            DDIMScheduler.from_config(config, rescale_betas_zero_snr=True),
            "rescale_betas_zero_snr=True",
        ),
        "2000 training steps": (
            DDIMScheduler.from_config(config, num_train_timesteps=2000),
            "num_train_timesteps=2000",
        ),
        "other trained betas": (
            DDIMScheduler.from_config(config, trained_betas=np.linspace(1e-4, 0.02, 1000).tolist()),
            "trained_betas='<1000 values>'",
        ),
        "flow matching": (FlowMatchEulerDiscreteScheduler(), "schedule of its own"),
        "EDM": (EDMEulerScheduler(), "schedule of its own"),
    }


@pytest.mark.parametrize("case", list(_bad_schedulers()))
def test_a_scheduler_that_would_draw_wrong_images_is_refused_before_any_model_runs(tiny_pipe, case):
    scheduler, fix = _bad_schedulers()[case]
    tiny_pipe.scheduler = scheduler
    calls = []
    for module in (tiny_pipe.transformer, tiny_pipe.text_encoder, tiny_pipe.vae):
        module.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError) as error:
        tiny_pipe("a red circle", num_inference_steps=3)
    message = str(error.value)
    assert type(scheduler).__name__ in message
    assert fix in message
    assert calls == []


def test_the_refusals_name_a_rebuild_that_works(tiny_pipe):
    """Each message's fix, applied as written, gives a scheduler the pipeline takes."""
    config = default_scheduler().config
    tiny_pipe.scheduler = DDIMScheduler.from_config(tiny_pipe.scheduler.config, clip_sample=False)
    tiny_pipe("a red circle", num_inference_steps=3, output_type="np")
    tiny_pipe.scheduler = DDIMScheduler.from_config(config)
    tiny_pipe("a red circle", num_inference_steps=3, output_type="np")
    tiny_pipe.scheduler = EulerDiscreteScheduler.from_config(config, prediction_type="epsilon")
    tiny_pipe("a red circle", num_inference_steps=3, output_type="np")
    # The schedule is what counts, however it is given: the training betas listed out are accepted.
    tiny_pipe.scheduler = DDIMScheduler(trained_betas=default_scheduler().betas.tolist(), clip_sample=False)
    image = tiny_pipe("a red circle", num_inference_steps=3, output_type="np").images
    assert np.isfinite(image).all()
