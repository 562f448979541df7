"""What `LMLPPipeline` refuses, saying what to change: components that do not fit the backbone, `__call__`'s arguments
(before any model runs) and non-finite results."""

import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch


OUTPUT_TYPES = ("pil", "np", "pt", "latent")
MAX_IMAGES_PER_CALL = 4096  # they are denoised as one batch, all in memory at once


def _is_integer(value: Any) -> bool:
    """True for Python and NumPy integers, not bools."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_components(transformer, text_encoder, tokenizer, vae) -> None:
    """Refuse a text encoder, tokenizer or VAE that does not fit the backbone's config (any may be None)."""
    if transformer is None:
        return
    config, name = transformer.config, type(transformer).__name__
    if text_encoder is not None and text_encoder.config.hidden_size != config.text_embed_dim:
        raise ValueError(
            f"The text encoder's hidden size is {text_encoder.config.hidden_size} but the {name} expects "
            f"text_embed_dim={config.text_embed_dim}; use the text encoder the backbone was trained with."
        )
    if tokenizer is not None and tokenizer.model_max_length != config.text_seq_len:
        raise ValueError(
            f"The tokenizer pads to model_max_length={tokenizer.model_max_length} but the {name} mixes "
            f"text_seq_len={config.text_seq_len} tokens; load it with model_max_length={config.text_seq_len}."
        )
    if vae is not None and vae.config.latent_channels != config.in_channels:
        raise ValueError(
            f"The VAE has latent_channels={vae.config.latent_channels} but the {name} takes "
            f"in_channels={config.in_channels}; use the VAE the backbone was trained with."
        )


def _check_call(
    pipe,
    *,
    prompt,
    negative_prompt,
    num_inference_steps,
    timesteps,
    sigmas,
    guidance_scale,
    num_images_per_prompt,
    generator,
    latents,
    prompt_embeds,
    negative_prompt_embeds,
    output_type,
    callback_on_step_end_tensor_inputs,
) -> int:
    """Refuse `pipe.__call__`'s arguments (as typed there) but the image size, naming the argument and what it may be;
    return B, the number of prompts."""
    if (prompt is None) == (prompt_embeds is None):
        raise ValueError(
            f"Pass exactly one of `prompt` and `prompt_embeds`, got {'both' if prompt is not None else 'neither'}."
        )
    if prompt is not None and not (
        isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(p, str) for p in prompt))
    ):
        raise ValueError(f"`prompt` must be a string or a list of strings, got {type(prompt).__name__}.")
    if prompt is not None and (pipe.tokenizer is None or pipe.text_encoder is None):
        raise ValueError("This pipeline has no tokenizer or text encoder; pass `prompt_embeds` instead of `prompt`.")
    batch_size = 1 if isinstance(prompt, str) else len(prompt) if prompt is not None else prompt_embeds.shape[0]
    if batch_size < 1:
        raise ValueError("`prompt` is an empty list; pass at least one prompt.")
    config = pipe.transformer.config
    expected = (batch_size, config.text_seq_len, config.text_embed_dim)
    for name, embeds in (("prompt_embeds", prompt_embeds), ("negative_prompt_embeds", negative_prompt_embeds)):
        if embeds is not None and embeds.shape != expected:
            raise ValueError(
                f"`{name}` must have shape (batch size, text_seq_len, text_embed_dim) = {expected}, got "
                f"{tuple(embeds.shape)}; compute it with `pipe.encode_prompt`."
            )
    if negative_prompt is not None and negative_prompt_embeds is not None:
        raise ValueError("Pass at most one of `negative_prompt` and `negative_prompt_embeds`, got both.")
    if negative_prompt is not None and not isinstance(negative_prompt, str) and len(negative_prompt) != batch_size:
        raise ValueError(
            f"`negative_prompt` has {len(negative_prompt)} entries but there are {batch_size} prompts; pass one "
            "per prompt, or one string for all."
        )
    if isinstance(guidance_scale, bool) or not (
        isinstance(guidance_scale, numbers.Real) and math.isfinite(guidance_scale)
    ):
        raise ValueError(f"`guidance_scale` must be a finite number, got {guidance_scale!r} (<= 1: no guidance).")
    if guidance_scale > 1 and negative_prompt_embeds is None and pipe.text_encoder is None:
        raise ValueError(
            'Guidance (guidance_scale > 1) without a text encoder needs `negative_prompt_embeds` (the states of "").'
        )
    _check_steps(pipe.scheduler, num_inference_steps, timesteps, sigmas)
    if not (_is_integer(num_images_per_prompt) and num_images_per_prompt >= 1):
        raise ValueError(f"`num_images_per_prompt` must be an integer, at least 1, got {num_images_per_prompt!r}.")
    num_images = batch_size * num_images_per_prompt
    if num_images > MAX_IMAGES_PER_CALL:
        raise ValueError(
            f"{batch_size} prompts × num_images_per_prompt={num_images_per_prompt} is {num_images:,} images, more than "
            f"the {MAX_IMAGES_PER_CALL} one call makes; make them in several calls."
        )
    generators = generator if isinstance(generator, list) else [] if generator is None else [generator]
    if not all(isinstance(g, torch.Generator) for g in generators):
        raise TypeError(
            f"`generator` must be a torch.Generator, a list of them (one per image), or None, got {generator!r}."
        )
    if isinstance(generator, list) and len(generator) != num_images:
        raise ValueError(
            f"Got a list of {len(generator)} generators for {num_images} images ({batch_size} prompts × "
            f"{num_images_per_prompt} per prompt); pass one per image, or a single generator."
        )
    if latents is not None and latents.shape != pipe._latents_shape(num_images):
        raise ValueError(
            f"`latents` must have shape (images, in_channels, sample_size, sample_size) = "
            f"{pipe._latents_shape(num_images)}, got {tuple(latents.shape)}."
        )
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"`output_type` must be one of {OUTPUT_TYPES}, got {output_type!r}.")
    unknown = set(callback_on_step_end_tensor_inputs) - set(pipe._callback_tensor_inputs)
    if unknown:
        raise ValueError(
            f"`callback_on_step_end_tensor_inputs` may only name {pipe._callback_tensor_inputs}, got {sorted(unknown)}."
        )
    return batch_size


def _check_schedule(name: str, schedule: Any, valid: str, is_valid: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Refuse `schedule` unless it is a non-empty, strictly decreasing list of numbers that `is_valid` (an (S,)
    float64 -> (S,) bool mask, False for NaN) accepts; `valid` says what is, in words."""
    try:
        values = torch.as_tensor(schedule, dtype=torch.float64, device="cpu")  # (S,)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"`{name}` must be a list of numbers, got {schedule!r}.") from error
    if values.ndim != 1:
        raise ValueError(f"`{name}` must be a list of numbers, got {schedule!r}.")
    if values.numel() == 0:
        raise ValueError(f"`{name}` is empty; pass at least one value, or leave it unset.")
    bad = values[~is_valid(values)]  # (K,)
    if bad.numel():
        raise ValueError(f"`{name}` must be {valid}, got {bad.tolist()} in {values.tolist()}.")
    if not (values[1:] < values[:-1]).all():
        raise ValueError(f"`{name}` must be strictly decreasing, got {values.tolist()}.")


def _check_steps(scheduler, num_inference_steps: Any, timesteps: list[int] | None, sigmas: list[float] | None) -> None:
    """Refuse custom `timesteps` or `sigmas` the scheduler does not take or that are not valid, or a number of
    steps outside [1, num_train_timesteps) (more would repeat timesteps, and multistep solvers return NaN)."""
    if timesteps is not None and sigmas is not None:
        raise ValueError("Pass at most one of `timesteps` and `sigmas`, got both.")
    for name, schedule in (("timesteps", timesteps), ("sigmas", sigmas)):
        if schedule is not None and name not in inspect.signature(scheduler.set_timesteps).parameters:
            raise ValueError(
                f"{type(scheduler).__name__} does not accept custom `{name}`; use `num_inference_steps` or another "
                "scheduler."
            )
    num_train_timesteps = scheduler.config.get("num_train_timesteps", 1000)
    if timesteps is not None:
        valid = f"integers in [0, {num_train_timesteps})"
        _check_schedule(
            "timesteps", timesteps, valid, lambda t: (t == t.round()) & (t >= 0) & (t < num_train_timesteps)
        )
    elif sigmas is not None:
        _check_schedule("sigmas", sigmas, "finite and >= 0", lambda s: s.isfinite() & (s >= 0))
    elif not (_is_integer(num_inference_steps) and 1 <= num_inference_steps < num_train_timesteps):
        raise ValueError(
            f"`num_inference_steps` must be an integer in [1, {num_train_timesteps - 1}] (fewer than the "
            f"scheduler's num_train_timesteps), got {num_inference_steps!r}."
        )


def _set_schedule(
    scheduler, num_inference_steps: int, timesteps: list[int] | None, sigmas: list[float] | None, device: torch.device
) -> int:
    """Set the scheduler's schedule, before the text encoder runs, refusing one with no denoising step (one sigma:
    the last is the end point); return the number of steps."""
    if timesteps is None and sigmas is None:
        scheduler.set_timesteps(num_inference_steps, device=device)
        return num_inference_steps
    name, schedule = ("timesteps", timesteps) if timesteps is not None else ("sigmas", sigmas)
    scheduler.set_timesteps(device=device, **{name: schedule})
    if len(scheduler.timesteps) == 0:
        raise ValueError(
            f"`{name}`={list(schedule)} gives {type(scheduler).__name__} no denoising steps; pass a longer `{name}`."
        )
    return len(scheduler.timesteps)


def _raise_if_not_finite(images: torch.Tensor, message: str) -> None:
    """Raise a `FloatingPointError` if images of the (B, ...) batch hold NaN or inf; `message` has `{bad}` (their
    indices) and `{total}`."""
    finite = torch.isfinite(images).flatten(1).all(1)  # (B,)
    if not finite.all():
        raise FloatingPointError(message.format(bad=(~finite).nonzero().flatten().tolist(), total=len(finite)))
