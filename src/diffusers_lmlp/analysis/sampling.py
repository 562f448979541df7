"""The inputs `routing` observes a backbone on: its own sampling trajectories.

Gates and attention depend on the tokens, so the pipeline samples the captions as usual (scheduler, guidance) while
hooks record every forward pass; the model's forward is not replaced. Caption i starts from the noise of seed
`seed + i`, so its trajectory does not depend on its batch.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..progress import progress_bar


@dataclass(frozen=True)
class SamplerSettings:
    """How the captions are sampled; caption i starts from the noise of seed `seed + i`."""

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
    """Sample every caption without decoding, calling `on_step(step, timestep)` after each step's backbone passes;
    returns the scheduler's timesteps in sampling order."""
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
