"""The inputs `routing` observes a backbone on: its own sampling trajectories.

Gates and attention depend on the tokens, so the backbone is watched where it works: the pipeline samples each
caption from seeded noise with its own scheduler and classifier-free guidance, and hooks on the backbone's modules
(`routing`, `attention`) record what every forward pass computes: the conditional one and, with guidance, the
unconditional one. Nothing in the model's forward is replaced. Caption i starts from the noise of seed `seed + i`,
so a caption's trajectory does not depend on the batch it is sampled in.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..progress import progress_bar


@dataclass(frozen=True)
class SamplerSettings:
    """How the captions are sampled.

    Args:
        num_inference_steps (`int`): Sampler steps per caption.
        guidance_scale (`float`): diffusers' guidance scale g (above 1: an unconditional pass at every step too).
        seed (`int`): Caption i starts from the noise of seed `seed + i`.
        batch_size (`int`): Captions per pipeline call.
    """

    num_inference_steps: int
    guidance_scale: float
    seed: int
    batch_size: int


def sample_trajectories(
    pipeline,
    captions: list[str],
    settings: SamplerSettings,
    on_step: Callable[[int, int], None] | None = None,
    progress: bool = True,
) -> list[int]:
    """Sample every caption (the images are not decoded), calling `on_step` after each sampler step.

    Args:
        pipeline (`LMLPPipeline`): The pipeline, on its device.
        captions (`list[str]`): The captions.
        settings (`SamplerSettings`): Steps, guidance, seed and batch size.
        on_step (`Callable[[int, int], None]`, *optional*): Called as `on_step(step, timestep)` once the backbone's
            passes of that step (of the current batch) have run.
        progress (`bool`, *optional*, defaults to `True`): Show a progress bar over the steps of every batch.

    Returns:
        `list[int]`: The scheduler's timesteps, in sampling order.
    """
    batch_size, num_inference_steps = settings.batch_size, settings.num_inference_steps
    batches = [captions[start : start + batch_size] for start in range(0, len(captions), batch_size)]
    timesteps: list[int] = []
    pipeline.set_progress_bar_config(disable=True)
    with progress_bar(len(batches) * num_inference_steps, "sampling", unit="step", disable=not progress) as bar:

        def after_step(pipe, step: int, timestep: torch.Tensor, tensors: dict) -> dict:
            if on_step is not None:
                on_step(step, int(timestep))
            if len(timesteps) < num_inference_steps:
                timesteps.append(int(timestep))
            bar.update()
            return {}

        for index, batch in enumerate(batches):
            first = index * batch_size
            generators = [torch.Generator().manual_seed(settings.seed + first + i) for i in range(len(batch))]
            pipeline(
                batch,
                num_inference_steps=num_inference_steps,
                guidance_scale=settings.guidance_scale,
                generator=generators,
                output_type="latent",
                callback_on_step_end=after_step,
            )
    return timesteps
