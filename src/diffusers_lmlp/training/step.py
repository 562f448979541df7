"""One optimizer step of ε-prediction training, as the papers train (U-ViT's and L-MLP's `train_t2i_discrete`): noise
and timesteps for the step's samples, the MSE between the predicted and the true noise, backward, clipping, the
optimizer and learning-rate steps, then the EMA update.

The step never writes anything. It checks that the loss and the gradient norm are finite before the optimizer
applies the gradients, so that a diverging run (a learning rate that is too high, corrupted cached features, an fp16
overflow) stops with `NonFiniteLossError` while the weights in memory and every checkpoint on disk are still good.

Every tensor it makes is made on the device and in the dtype of the tensors it is given (the noise and timesteps are
drawn on the CPU from the step's generator, for exact resumes on any device, then moved; the model gets the
timesteps on the CPU), so the same code runs on CPU, GPU, and the fake device that tests/test_device_readiness.py
runs it on. Apart from `check_finite`, it reads nothing back from the device.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate.utils import DistributedType
from diffusers import DDPMScheduler
from diffusers.training_utils import EMAModel, compute_snr

from ..models import load_balancing_loss, symmetry_breaking_penalty


# Where accelerate holds the gradients or shards them across processes: only its `clip_grad_norm_` measures them.
ACCELERATE_HELD_GRADIENTS = (
    DistributedType.FSDP,
    DistributedType.DEEPSPEED,
    DistributedType.XLA,
    DistributedType.MEGATRON_LM,
)


@dataclass(frozen=True)
class LossOptions:
    """What the training loss adds to the papers' plain ε-MSE.

    Args:
        snr_gamma (`float`, *optional*): Min-SNR weighting of the MSE (Hang et al. 2023; 5.0 is the usual value).
        noise_offset (`float`, *optional*, defaults to 0.0): Scale of a per-channel offset added to the noise.
        load_balance_weight (`float`, *optional*, defaults to 0.0): Weight of the MoE-MLP's load-balancing loss.
        symmetry_breaking_weight (`float`, *optional*, defaults to 0.0): Weight of the AsymMixer's penalty.
        max_grad_norm (`float`, *optional*): Clip the gradients to this norm (the norm is measured either way).
    """

    snr_gamma: float | None = None
    noise_offset: float = 0.0
    load_balance_weight: float = 0.0
    symmetry_breaking_weight: float = 0.0
    max_grad_norm: float | None = None


@dataclass
class StepResult:
    """What one optimizer step measured.

    Args:
        loss (`torch.Tensor`): The step's loss, averaged over its micro-batches and over every process (0-dim).
        grad_norm (`torch.Tensor`): The gradient norm before clipping (0-dim).
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor


class NonFiniteLossError(FloatingPointError):
    """The loss or the gradient norm of a step is NaN or inf: the step was not applied.

    Args:
        step (`int`): The optimizer step that failed (1-based, as checkpoints count).
        loss (`float`): Its loss.
        grad_norm (`float`): Its gradient norm.
    """

    def __init__(self, step: int, loss: float, grad_norm: float):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        super().__init__(f"the loss is {loss} at step {step} (gradient norm {grad_norm})")


def draw_noise(
    latents: torch.Tensor, generator: torch.Generator, num_train_timesteps: int, noise_offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The noise and the timesteps of a step's samples, drawn from the step's CPU generator.

    Args:
        latents (`torch.Tensor`): (B, C, h, w) clean latents; the noise gets their device and dtype.
        generator (`torch.Generator`): The step's generator (CPU), where the batch left it.
        num_train_timesteps (`int`): The scheduler's number of training timesteps.
        noise_offset (`float`, *optional*, defaults to 0.0): Scale of a per-channel offset added to the noise.

    Returns:
        `tuple[torch.Tensor, torch.Tensor]`: The noise (B, C, h, w) and the timesteps (B,) int64, on the CPU.
    """
    noise = torch.randn(latents.shape, generator=generator).to(latents)  # (B, C, h, w)
    if noise_offset:
        noise += noise_offset * torch.randn(latents.shape[:2] + (1, 1), generator=generator).to(latents)
    timesteps = torch.randint(0, num_train_timesteps, (latents.shape[0],), generator=generator)  # (B,)
    return noise, timesteps


def diffusion_loss(
    model: torch.nn.Module,
    noisy: torch.Tensor,
    text_states: torch.Tensor,
    timesteps: torch.Tensor,
    noise: torch.Tensor,
    noise_scheduler: DDPMScheduler,
    options: LossOptions,
) -> torch.Tensor:
    """The loss of one micro-batch: the ε-prediction MSE (Min-SNR weighted with `snr_gamma`), plus the MoE-MLP's
    load-balancing loss and the AsymMixer's penalty when their weights are set.

    Args:
        model (`torch.nn.Module`): The backbone (prepared by accelerate, or plain).
        noisy (`torch.Tensor`): (b, C, h, w) noised latents.
        text_states (`torch.Tensor`): (b, T, D) text encoder states.
        timesteps (`torch.Tensor`): (b,) timesteps, on the CPU.
        noise (`torch.Tensor`): (b, C, h, w) the noise to predict.
        noise_scheduler (`DDPMScheduler`): The training scheduler (for the SNR).
        options (`LossOptions`): The loss's extra terms.

    Returns:
        `torch.Tensor`: The loss (0-dim, float32).
    """
    # The timesteps stay on the CPU, where the model checks their range without waiting for the device (a DDP or
    # FSDP wrapper moves its inputs to the device first: with several processes, that check waits).
    out = model(
        noisy, text_states, timesteps, **({"output_router_probs": True} if options.load_balance_weight else {})
    )
    mse = F.mse_loss(out.sample.float(), noise.float(), reduction="none").mean(dim=(1, 2, 3))  # (b,)
    if options.snr_gamma is not None:
        # On the device, where `add_noise` has moved the schedule's ᾱ: a CPU lookup would copy it back every step.
        snr = compute_snr(noise_scheduler, timesteps.to(mse.device))  # (b,)
        mse = mse * torch.clamp(snr, max=options.snr_gamma).to(mse) / snr.to(mse)
    loss = mse.mean()
    if options.load_balance_weight:
        loss = loss + load_balancing_loss(out.router_probs, weight=options.load_balance_weight)
    if options.symmetry_breaking_weight:
        loss = loss + options.symmetry_breaking_weight * symmetry_breaking_penalty(model)
    return loss


def training_step(
    accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler,
    noise_scheduler: DDPMScheduler,
    latents: torch.Tensor,
    text_states: torch.Tensor,
    generator: torch.Generator,
    micro_batch_size: int,
    options: LossOptions,
    step: int,
    ema: EMAModel | None = None,
    parameters: list[torch.nn.Parameter] | None = None,
) -> StepResult:
    """One optimizer step over a process's samples, in micro-batches of `micro_batch_size` (gradient accumulation).

    Args:
        accelerator (`Accelerator`): The run's accelerator (accumulation, backward, clipping, the loss's gather).
        model (`torch.nn.Module`): The backbone, prepared by `accelerator`.
        optimizer (`torch.optim.Optimizer`): Its optimizer, prepared.
        lr_scheduler: Its learning-rate scheduler, prepared.
        noise_scheduler (`DDPMScheduler`): The training noise schedule.
        latents (`torch.Tensor`): (B, C, h, w) scaled clean latents of the step, on the model's device.
        text_states (`torch.Tensor`): (B, T, D) their text states, caption dropout applied.
        generator (`torch.Generator`): The step's CPU generator, where the batch left it.
        micro_batch_size (`int`): Samples per forward (`--train_batch_size`).
        options (`LossOptions`): The loss's extra terms and the clipping norm.
        step (`int`): The number of this step (1-based), for the error.
        ema (`EMAModel`, *optional*): The EMA weights, updated after the optimizer step (on the model's device, where
            they move at the first step: `update_ema`).
        parameters (`list[torch.nn.Parameter]`, *optional*): `list(model.parameters())`, the weights the EMA averages,
            listed once by a caller that steps many times (defaults to listing them at this step: `update_ema`).

    Returns:
        `StepResult`: The step's loss (over every process) and gradient norm.

    Raises:
        `NonFiniteLossError`: When the loss or the gradient norm is NaN or inf; the optimizer has not applied the
            gradients, and every process raises it at the same step.
    """
    noise, timesteps = draw_noise(latents, generator, noise_scheduler.config.num_train_timesteps, options.noise_offset)
    noisy = noise_scheduler.add_noise(latents, noise, timesteps.to(latents.device))  # (B, C, h, w)
    accumulation = max(1, math.ceil(latents.shape[0] / micro_batch_size))
    step_loss = torch.zeros((), device=latents.device)
    grad_norm = loss = None
    for start in range(0, latents.shape[0], micro_batch_size):
        part = slice(start, start + micro_batch_size)
        with accelerator.accumulate(model):
            micro_loss = diffusion_loss(
                model, noisy[part], text_states[part], timesteps[part], noise[part], noise_scheduler, options
            )
            accelerator.backward(micro_loss)
            step_loss += micro_loss.detach() / accumulation
            if accelerator.sync_gradients:
                # Logged and checked; the gradients are clipped with --max_grad_norm.
                grad_norm = gradient_norm(accelerator, model, optimizer, options.max_grad_norm)
                loss = accelerator.gather(step_loss[None]).mean()  # (): the same on every process
                try:
                    check_finite(loss, grad_norm, step)
                except NonFiniteLossError:
                    optimizer.zero_grad(set_to_none=True)  # the gradients are never applied
                    raise
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    if ema is not None:
        update_ema(ema, list(model.parameters()) if parameters is None else parameters)
    return StepResult(loss=loss, grad_norm=torch.as_tensor(grad_norm))


def gradient_norm(
    accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float | None
) -> torch.Tensor:
    """The 2-norm of the step's gradients, measured before they are clipped to `max_grad_norm` (when it is set).

    accelerate's `clip_grad_norm_` always scales the gradients, by 1 when they are within the norm: without clipping,
    that is one more read and write of every gradient per step. So without `--max_grad_norm` the norm is measured
    alone, after the same unscaling (fp16), as torch's `clip_grad_norm_` measures it: the same value. The gradients
    are those of the weights the optimizer steps, the model's weights that require one, in the model's order (so the
    model's modules are not walked again). Where accelerate holds or shards the gradients (FSDP, DeepSpeed, XLA,
    Megatron-LM, or DTensor gradients), its own call measures them.

    Args:
        accelerator (`Accelerator`): The run's accelerator.
        model (`torch.nn.Module`): The prepared backbone, its gradients synchronized.
        optimizer (`torch.optim.Optimizer`): Its optimizer, which holds every weight that has a gradient.
        max_grad_norm (`float`, *optional*): Clip the gradients to this norm.

    Returns:
        `torch.Tensor`: The norm (0-dim, on the gradients' device).
    """
    gradients = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if (
        max_grad_norm is not None
        or accelerator.distributed_type in ACCELERATE_HELD_GRADIENTS
        or has_dtensors(gradients)
        or not gradients
    ):
        return accelerator.clip_grad_norm_(model.parameters(), math.inf if max_grad_norm is None else max_grad_norm)
    accelerator.unscale_gradients()
    # torch's `get_total_norm` without its grouping of the tensors by device and dtype (one device here; `stack`
    # promotes mixed dtypes): the same two ops.
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gradients)))  # ()


def has_dtensors(tensors: list[torch.Tensor]) -> bool:
    """Whether any of `tensors` is a distributed tensor (tensor parallelism, FSDP2), whose norm needs its mesh."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(tensor, DTensor) for tensor in tensors)


def update_ema(ema: EMAModel, parameters: list[torch.nn.Parameter]) -> None:
    """Update the EMA weights from the model's, on the model's device.

    The shadow weights are made on the CPU (the EMA is built before `accelerator.prepare` moves the model, and a resume
    loads them from a checkpoint on the CPU), and `EMAModel.step` mixes them with the model's weights in place; so
    they move to the model's device first, once (`ema.to` moves them all, so the first one tells).

    The trainer lists the parameters once per run: they are the same tensors at every step (loads copy into them, and
    the optimizer holds them too), and listing them walks the prepared model's modules.

    Args:
        ema (`EMAModel`): The EMA weights.
        parameters (`list[torch.nn.Parameter]`): The model's parameters, in the order the EMA was made with.
    """
    if parameters and ema.shadow_params[0].device != parameters[0].device:
        ema.to(device=parameters[0].device)
    ema.step(parameters)


def check_finite(loss: torch.Tensor, grad_norm: torch.Tensor | float, step: int) -> None:
    """Raise `NonFiniteLossError` unless the step's loss and gradient norm are finite.

    Both are the same on every process (the gradients are all-reduced and the loss gathered before this), so every
    process stops at the same step. This is the step's one read of a value back from the device.

    Args:
        loss (`torch.Tensor`): The step's loss over every process (0-dim).
        grad_norm (`torch.Tensor` or `float`): The gradient norm before clipping.
        step (`int`): The step's number, for the error.
    """
    grad_norm = torch.as_tensor(grad_norm).to(loss.device)
    if not bool(torch.isfinite(loss) & torch.isfinite(grad_norm)):
        raise NonFiniteLossError(step, float(loss), float(grad_norm))


def non_finite_parameters(*modules: torch.nn.Module, ema: EMAModel | None = None) -> list[str]:
    """The names of the parameters that hold NaN or inf (the EMA's shadow weights as `ema.<i>`), checked before a
    checkpoint or the pipeline is written.

    Args:
        *modules (`torch.nn.Module`): The modules to check.
        ema (`EMAModel`, *optional*): The EMA weights.
    """
    bad = [name for module in modules for name, p in module.named_parameters() if not torch.isfinite(p).all()]
    if ema is not None:
        bad += [f"ema.{i}" for i, p in enumerate(ema.shadow_params) if not torch.isfinite(p).all()]
    return bad
