"""`LMLPPipeline.__call__`: generation, guidance, inputs and outputs, casting, and the tiny offline components."""

import inspect
import json
import logging

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, EulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from diffusers_lmlp import LMLPPipeline, default_scheduler
from diffusers_lmlp.models.loading import EmptyFp32ModulesWarning
from diffusers_lmlp.tiny import TINY_VOCAB_WORDS, build_tiny_pipeline, tiny_clip_tokenizer


NATIVE = 16  # tiny pipeline: 8×8 latents × VAE factor 2
LATENT_SHAPE = (4, 8, 8)
TEXT_SHAPE = (16, 32)  # text_seq_len, text_embed_dim
MODELS_LOG = "diffusers.models.modeling_utils"


def test_guidance_follows_diffusers_convention_with_the_empty_prompt_as_unconditional_context(pipe, generate):
    # One step by hand: ε = ε_u + g·(ε_c − ε_u), with ε_u from the text encoder's states of "".
    latents = randn_tensor((1, *LATENT_SHAPE), generator=torch.Generator().manual_seed(0))
    scheduler = default_scheduler()
    scheduler.set_timesteps(1)
    t = scheduler.timesteps[0]
    with torch.no_grad():
        cond, uncond = pipe.encode_prompt("a red circle", "cpu")
        eps_cond = pipe.transformer(latents, cond, t).sample
        eps_uncond = pipe.transformer(latents, uncond, t).sample
    expected = scheduler.step(eps_uncond + 3.0 * (eps_cond - eps_uncond), t, latents).prev_sample
    out = pipe("a red circle", num_inference_steps=1, guidance_scale=3.0, latents=latents, output_type="latent")
    torch.testing.assert_close(out.images, expected, rtol=1e-4, atol=1e-5)
    # Any guidance_scale <= 1 skips the unconditional pass, as in diffusers; the unconditional context is "".
    torch.testing.assert_close(generate(pipe, guidance_scale=0.5), generate(pipe, guidance_scale=1), rtol=0, atol=0)
    default = generate(pipe, guidance_scale=3.0)
    torch.testing.assert_close(generate(pipe, guidance_scale=3.0, negative_prompt=""), default, rtol=0, atol=0)
    assert not torch.allclose(generate(pipe, guidance_scale=3.0, negative_prompt="blue"), default)
    # A generator or its latents reproduce the images.
    first = generate(pipe, seed=0)
    torch.testing.assert_close(generate(pipe, seed=0), first, rtol=0, atol=0)
    assert not torch.allclose(generate(pipe, seed=1), first)
    torch.testing.assert_close(generate(pipe, seed=1, latents=latents), first, rtol=0, atol=0)  # not the generator's
    assert not torch.allclose(generate(pipe, prompt="a blue square", latents=latents), first)


@pytest.mark.parametrize("num_prompts, per_prompt, guidance", [(1, 2, 1.0), (2, 1, 0.0), (2, 3, 2.5)])
def test_output_shapes_and_one_backbone_forward_per_step(pipe, record_batches, num_prompts, per_prompt, guidance):
    # guidance <= 1: conditional batch only; guidance > 1: [uncond | cond] batched in one forward.
    transformer_batches, text_encoder_batches = record_batches(pipe.transformer), record_batches(pipe.text_encoder)
    prompts, num_images = ["a red circle", "a blue square"][:num_prompts], num_prompts * per_prompt
    generators = [torch.Generator().manual_seed(i) for i in range(num_images)]
    kwargs = {"num_inference_steps": 3, "num_images_per_prompt": per_prompt, "generator": generators}
    images = pipe(prompts, output_type="np", guidance_scale=guidance, **kwargs).images
    assert images.shape == (num_images, NATIVE, NATIVE, 3)
    assert transformer_batches == [num_images * (1 + (guidance > 1))] * 3
    assert len(text_encoder_batches) == 1 + (guidance > 1)
    assert len(pipe(prompts, output_type="pil", **kwargs).images) == num_images


def test_prompt_and_prompt_embeds_paths_give_the_same_images_and_keep_a_prompts_images_together(pipe, generate):
    prompts, negatives = ["a red circle", "a blue square"], ["green", "yellow"]
    from_prompts = generate(pipe, prompt=prompts, guidance_scale=2.0, negative_prompt=negatives)
    prompt_embeds, negative_prompt_embeds = pipe.encode_prompt(prompts, "cpu", negative_prompt=negatives)
    embeds = {"prompt": None, "prompt_embeds": prompt_embeds, "guidance_scale": 2.0}
    torch.testing.assert_close(generate(pipe, **embeds, negative_prompt_embeds=negative_prompt_embeds), from_prompts)
    # prompt_embeds alone: the unconditional context is still the encoding of "".
    torch.testing.assert_close(generate(pipe, **embeds), generate(pipe, prompt=prompts, guidance_scale=2.0))
    prompt_embeds, negative_prompt_embeds = pipe.encode_prompt(prompts, "cpu", num_images_per_prompt=2)
    assert prompt_embeds.shape == negative_prompt_embeds.shape == (4, *TEXT_SHAPE)  # a prompt's images consecutive
    assert torch.equal(prompt_embeds[0], prompt_embeds[1]) and torch.equal(prompt_embeds[2], prompt_embeds[3])
    assert not torch.equal(prompt_embeds[1], prompt_embeds[2])


def test_callbacks_read_and_replace_latents_and_can_change_guidance(pipe, generate):
    seen = []

    def callback(pipeline, step, timestep, callback_kwargs):
        seen.append((step, tuple(callback_kwargs["latents"].shape), tuple(callback_kwargs["prompt_embeds"].shape)))
        pipeline._guidance_scale += 1.0
        if step == pipeline.num_timesteps - 1:
            return {"latents": torch.zeros_like(callback_kwargs["latents"])}
        return {}

    inputs = {"callback_on_step_end": callback, "callback_on_step_end_tensor_inputs": ["latents", "prompt_embeds"]}
    latents = generate(pipe, num_inference_steps=3, guidance_scale=2.0, output_type="latent", **inputs)
    assert seen == [(step, (1, *LATENT_SHAPE), (1, *TEXT_SHAPE)) for step in range(3)]
    assert torch.count_nonzero(latents) == 0 and pipe.guidance_scale == 2.0 + pipe.num_timesteps


def test_every_output_type_decoded_with_the_vae_scaling_and_shift_sliced_or_tiled_alike(pipe, generate):
    pipe.vae.register_to_config(scaling_factor=0.5, shift_factor=0.25)
    latents = generate(pipe, prompt=["a red circle", "a blue square"], output_type="latent")
    with torch.no_grad():
        expected = (pipe.vae.decode(latents / 0.5 + 0.25).sample / 2 + 0.5).clamp(0, 1)
    for switch in ("enable", "disable"):  # decoded whole, then sliced and tiled
        torch.testing.assert_close(generate(pipe, prompt=["a red circle", "a blue square"]), expected)
        getattr(pipe, f"{switch}_vae_slicing")()
        getattr(pipe, f"{switch}_vae_tiling")()
        assert pipe.vae.use_slicing is pipe.vae.use_tiling is (switch == "enable")
    pt = generate(pipe, output_type="pt")
    np_images = generate(pipe, output_type="np")
    assert isinstance(np_images, np.ndarray) and np_images.shape == (1, NATIVE, NATIVE, 3)
    np.testing.assert_allclose(np_images, pt.permute(0, 2, 3, 1).numpy(), atol=1e-6)
    pil = generate(pipe, output_type="pil")
    assert isinstance(pil[0], PIL.Image.Image) and pil[0].size == (NATIVE, NATIVE)
    np.testing.assert_allclose(np.asarray(pil[0]) / 255, np_images[0], atol=1 / 255 + 1e-6)
    assert generate(pipe, output_type="latent").shape == (1, *LATENT_SHAPE)
    out = pipe("a red circle", num_inference_steps=2, return_dict=False)
    assert isinstance(out, tuple) and isinstance(out[0][0], PIL.Image.Image)


def test_defaults_follow_the_papers_and_custom_timesteps_and_sigmas_pass_through(pipe, generate):
    parameters = inspect.signature(LMLPPipeline.__call__).parameters
    assert (parameters["num_inference_steps"].default, parameters["guidance_scale"].default) == (50, 2.0)  # s = 1
    scheduler = default_scheduler()
    assert isinstance(scheduler, DPMSolverMultistepScheduler)
    keys = ("algorithm_type", "beta_schedule", "beta_start", "beta_end", "num_train_timesteps", "prediction_type")
    assert [scheduler.config[k] for k in keys] == ["dpmsolver++", "scaled_linear", 0.00085, 0.012, 1000, "epsilon"]
    assert pipe.native_size == NATIVE and generate(pipe, height=None, width=None).shape[-2:] == (NATIVE, NATIVE)
    generate(pipe, timesteps=[999, 600, 300])
    assert pipe.scheduler.timesteps.tolist() == [999, 600, 300] and pipe.num_timesteps == 3
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    images = generate(pipe, sigmas=[14.6, 3.0, 0.5])
    assert pipe.num_timesteps == 2 and torch.isfinite(images).all()


@pytest.mark.skipif(not torch.accelerator.is_available(), reason="model CPU offload needs an accelerator")
def test_model_cpu_offload(make_pipe, generate):
    device = torch.accelerator.current_accelerator()
    on_device = generate(make_pipe().to(device))
    pipe = make_pipe()
    pipe.enable_model_cpu_offload(device=device)
    torch.testing.assert_close(generate(pipe), on_device, rtol=1e-3, atol=1e-3)
    assert pipe.transformer.device.type == "cpu"  # back on the CPU after the call


def test_tiny_components_are_deterministic_leave_the_global_rng_alone_and_tokenize_any_word(tmp_path):
    rng_state = torch.get_rng_state()
    first, second, other = build_tiny_pipeline(seed=0), build_tiny_pipeline(seed=0), build_tiny_pipeline(seed=1)
    assert torch.equal(torch.get_rng_state(), rng_state)
    for name in ("transformer", "text_encoder", "vae"):
        torch.testing.assert_close(*(getattr(p, name).state_dict() for p in (first, second)), rtol=0, atol=0)
        assert not torch.equal(*(next(getattr(p, name).parameters()) for p in (first, other)))
    tokenizer = tiny_clip_tokenizer(model_max_length=77, save_directory=tmp_path)
    assert (tmp_path / "merges.txt").read_text().startswith("#version: 0.2\n")
    assert len(json.loads((tmp_path / "vocab.json").read_text())) == len(tokenizer)
    assert tokenizer.model_max_length == 77
    for word in TINY_VOCAB_WORDS:
        tokens = tokenizer.convert_ids_to_tokens(tokenizer(word).input_ids)
        assert tokens == ["<|startoftext|>", f"{word}</w>", "<|endoftext|>"]
    ids = tokenizer("A zebra", padding="max_length", max_length=77).input_ids
    assert len(ids) == 77 and tokenizer.decode(ids, skip_special_tokens=True) == "a zebra"
    assert tokenizer.convert_ids_to_tokens(ids[:8]) == ["<|startoftext|>", "a</w>", *"zebr", "a</w>", "<|endoftext|>"]


@pytest.fixture
def models_log(caplog, monkeypatch):
    """The messages diffusers' models log (where `ModelMixin.to` warns)."""
    monkeypatch.setattr(logging.getLogger("diffusers"), "propagate", True)
    caplog.set_level(logging.WARNING, MODELS_LOG)
    return lambda: [r.getMessage() for r in caplog.records if r.name == MODELS_LOG]


def test_from_pipe_keeps_the_dtype_and_to_casts_without_a_vacuous_warning(make_pipe, models_log):
    pipe = make_pipe().to(torch.bfloat16)
    view = LMLPPipeline.from_pipe(pipe)
    # diffusers 0.42 would cast to float32 (huggingface/diffusers#12754), and warn of float32 modules it names as none.
    assert view.dtype == pipe.dtype == pipe.transformer.dtype == torch.bfloat16
    assert models_log() == []
    view = LMLPPipeline.from_pipe(pipe, dtype=torch.float32)  # diffusers' `from_pipe`: shared modules cast too
    assert view.dtype == pipe.transformer.dtype == torch.float32
    # Casting with `to` samples in bf16, without the warning of float32 modules it names as none.
    pipe = make_pipe().to(torch.bfloat16)
    assert pipe.transformer.dtype == pipe.vae.dtype == torch.bfloat16
    assert pipe.transformer.to(torch.float32).dtype == torch.float32
    assert pipe.to("cpu", torch.float32) is pipe and pipe.vae.dtype == torch.float32
    pipe.vae.to(torch.bfloat16)  # diffusers' own model, outside the pipeline's `to`: its warning stays
    pipe.to("cpu", torch.bfloat16)
    assert {pipe.transformer.dtype, pipe.text_encoder.dtype, pipe.vae.dtype} == {torch.bfloat16}
    images = pipe("a red circle", num_inference_steps=2, output_type="np").images
    assert images.shape == (1, NATIVE, NATIVE, 3) and np.isfinite(images).all()
    assert [message.split(":")[0] for message in models_log()] == [
        "There are modules in AutoencoderKL that should be kept in float32"
    ]
    # Only the vacuous warning is filtered:
    for named, kept in [("AutoencoderKL", "[]"), ("T5EncoderModel", "['wo']")]:
        message = f"There are modules in {named} that should be kept in float32: {kept}. Casting directly with ..."
        record = logging.LogRecord(MODELS_LOG, logging.WARNING, "", 0, message, None, None)
        assert bool(EmptyFp32ModulesWarning().filter(record)) is (kept != "[]")
