"""One optimizer step of ε-prediction training, checked before the update; the run's precision, compilation, AdamW."""

import collections
import math
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from diffusers import DDPMScheduler
from diffusers.training_utils import EMAModel, compute_snr

from ..cpu import this_cpu
from ..models import load_balancing_loss, symmetry_breaking_penalty


EXPLOSION_FACTOR, EXPLOSION_WINDOW = 1e4, 100  # a step over this × the last healthy steps' median diverged
AUTO_MIN_STEPS = 1000  # below this many steps `--torch_compile auto` does not compile: it would not pay off


@dataclass(frozen=True)
class LossOptions:  # what the loss adds to the plain ε-MSE, and the clipping norm
    snr_gamma: float | None = None
    noise_offset: float = 0.0
    load_balance_weight: float = 0.0
    symmetry_breaking_weight: float = 0.0
    max_grad_norm: float | None = None


@dataclass
class StepResult:  # one step's loss over every process and its gradient norm before clipping (0-dim each)
    loss: torch.Tensor
    grad_norm: torch.Tensor


class DivergenceError(FloatingPointError):
    """The loss or gradient norm of `step` (1-based) is NaN, inf, or exploded (`why`): the step was not applied."""

    def __init__(self, step: int, loss: float, grad_norm: float, why: str = ""):
        self.step, self.loss, self.grad_norm = step, loss, grad_norm
        super().__init__(f"the loss is {loss} at step {step} (gradient norm {grad_norm}){why}")


def draw_noise(
    latents: torch.Tensor, generator: torch.Generator, num_train_timesteps: int, noise_offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The noise (like `latents`) and timesteps (B,) of a step's samples, drawn from the step's CPU generator."""
    noise = torch.randn(latents.shape, generator=generator).to(latents)  # (B, C, h, w)
    if noise_offset:
        noise += noise_offset * torch.randn(latents.shape[:2] + (1, 1), generator=generator).to(latents)
    timesteps = torch.randint(0, num_train_timesteps, (latents.shape[0],), generator=generator)  # (B,)
    return noise, timesteps


def diffusion_loss(model, noisy, text_states, timesteps, noise, noise_scheduler, options: LossOptions) -> torch.Tensor:
    """The loss of one micro-batch (0-dim, float32): the ε-MSE (Min-SNR weighted), plus the weighted extra losses."""
    extra = {"output_router_probs": True} if options.load_balance_weight else {}
    out = model(noisy, text_states, timesteps, **extra)  # timesteps on the CPU: checked without waiting for the device
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
    accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler,
    noise_scheduler: DDPMScheduler, latents: torch.Tensor, text_states: torch.Tensor, generator: torch.Generator,
    micro_batch_size: int, options: LossOptions, step: int, ema: EMAModel | None = None,
    history: collections.deque | None = None,
) -> StepResult:  # fmt: skip
    """One optimizer step over a process's samples, in micro-batches; `DivergenceError` on every process at the same
    step before the update, also for a step that exploded against `history`."""
    noise, timesteps = draw_noise(latents, generator, noise_scheduler.config.num_train_timesteps, options.noise_offset)
    noisy = noise_scheduler.add_noise(latents, noise, timesteps.to(latents.device))  # (B, C, h, w)
    accumulation = max(1, math.ceil(latents.shape[0] / micro_batch_size))
    step_loss = torch.zeros((), device=latents.device)
    grad_norm = loss = None
    for start in range(0, latents.shape[0], micro_batch_size):
        part = slice(start, start + micro_batch_size)
        with accelerator.accumulate(model):
            inputs = noisy[part], text_states[part], timesteps[part], noise[part]
            micro_loss = diffusion_loss(model, *inputs, noise_scheduler, options)
            accelerator.backward(micro_loss)
            step_loss += micro_loss.detach() / accumulation
            if accelerator.sync_gradients:
                grad_norm = gradient_norm(accelerator, model, options.max_grad_norm)
                loss = accelerator.gather(step_loss[None]).mean()  # (): the same on every process
                try:
                    check_finite(loss, grad_norm, step, history)
                except DivergenceError:
                    optimizer.zero_grad(set_to_none=True)  # the gradients are never applied
                    raise
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    if ema is not None:
        update_ema(ema, model)
    return StepResult(loss=loss, grad_norm=torch.as_tensor(grad_norm))


def gradient_norm(accelerator, model: torch.nn.Module, max_grad_norm: float | None) -> torch.Tensor:
    """The 2-norm of the step's gradients before clipping to `max_grad_norm` (none without it), as accelerate
    measures it: right under DDP, FSDP, DeepSpeed and fp16's loss scale alike."""
    return accelerator.clip_grad_norm_(model.parameters(), math.inf if max_grad_norm is None else max_grad_norm)


def update_ema(ema: EMAModel, model: torch.nn.Module) -> None:
    """Update the EMA from `model`; its shadow weights, made or loaded on the CPU, first move to their device."""
    parameters = list(model.parameters())
    if parameters and ema.shadow_params[0].device != parameters[0].device:
        ema.to(device=parameters[0].device)
    ema.step(parameters)


def check_finite(
    loss: torch.Tensor, grad_norm: torch.Tensor | float, step: int, history: collections.deque | None = None
) -> None:
    """`DivergenceError` unless the loss and gradient norm are finite and not exploded against `history`."""
    grad_norm = torch.as_tensor(grad_norm).to(loss.device)
    values = torch.stack([loss.detach().float().reshape(()), grad_norm.float().reshape(())]).tolist()
    if not all(math.isfinite(value) for value in values):
        raise DivergenceError(step, *values)
    if history:
        medians = [statistics.median(past[i] for past in history) for i in range(2)]
        if any(value > EXPLOSION_FACTOR * median for value, median in zip(values, medians)):
            raise DivergenceError(
                step, *values, f", over {EXPLOSION_FACTOR:g}× the median of the last {len(history)} steps "
                f"(loss {medians[0]:.3g}, gradient norm {medians[1]:.3g})"
            )  # fmt: skip
    if history is not None:
        history.append(values)


def non_finite_parameters(*modules: torch.nn.Module, ema: EMAModel | None = None) -> list[str]:
    """The names of the parameters holding NaN or inf (the EMA's as `ema.<i>`)."""
    bad = [name for module in modules for name, p in module.named_parameters() if not torch.isfinite(p).all()]
    if ema is not None:
        bad += [f"ema.{i}" for i, p in enumerate(ema.shadow_params) if not torch.isfinite(p).all()]
    return bad


def launch_device() -> str:
    """The device type the run's `Accelerator` will train on, before it is built: "cuda" or "cpu"."""
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    return "cuda" if torch.cuda.is_available() and not use_cpu else "cpu"


def choose_precision(requested: str | None) -> tuple[str | None, str]:
    """The `Accelerator`'s `mixed_precision` for `--mixed_precision` (`auto`: bf16 where it is native), and why."""
    if requested != "auto":
        return requested, ""
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")  # `accelerate launch --mixed_precision` or its config
    if launched not in (None, "no"):
        return None, f" (auto: the launch's {launched} is kept)"
    if launch_device() == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", f" (auto: {torch.cuda.get_device_name()} runs bf16 natively)"
        return "no", f" (auto: {torch.cuda.get_device_name()} has no native bf16)"
    cpu = this_cpu()
    if cpu.native_bf16:
        return "bf16", f" (auto: the CPU has native bf16, {cpu.native_bf16}: {cpu.describe()})"
    return "no", f" (auto: float32, the CPU has no native bf16 (avx512_bf16 or AMX): {cpu.describe()})"


def effective_precision(accelerator: Accelerator, requested: str | None, preset: str | None) -> str:
    """The precision the run trains in, for the log; on a CPU the fp16 of a `preset` (the one that chose `requested`)
    is float32, an fp16 asked for refused."""
    precision = accelerator.mixed_precision
    if precision != "fp16" or accelerator.device.type != "cpu":
        return precision
    if requested == "fp16" and preset:
        return f"float32: the {preset} preset's fp16 needs a GPU"
    raise SystemExit("error: fp16 mixed precision needs a GPU, and this run is on the CPU: pass --mixed_precision no.")


def choose_compilation(requested: str | None, max_train_steps: int) -> tuple[str | None, str]:
    """The `dynamo_backend` for `--torch_compile` (`auto`: inductor if a trial works and the run is long), and why."""
    if requested is None:
        return None, ""
    if requested != "auto":
        return ("inductor" if requested == "yes" else "no"), ""
    launched = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()  # `accelerate launch --dynamo_backend`
    if launched != "no":
        return None, f" (auto: the launch's {launched} is kept)"
    if max_train_steps < AUTO_MIN_STEPS:
        return "no", f" (auto: {max_train_steps} steps do not repay a compilation; --torch_compile yes compiles)"
    start = time.perf_counter()
    try:  # a CPU needs a C++ compiler, a GPU Triton
        trial = torch.compile(lambda x: F.gelu(x) * 2.0 + 1.0, backend="inductor", fullgraph=True)
        trial(torch.linspace(-1.0, 1.0, 16, device=launch_device()))
    except Exception as error:  # any failure (no compiler, no Triton, an old Python) means: do not compile
        problem = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
        return "no", f" (auto: torch.compile does not work here, {problem}; training uncompiled)"
    finally:
        torch._dynamo.reset()  # the trial's cache entries are of no use to the run
    return "inductor", f" (auto: inductor works here, a trial compilation took {time.perf_counter() - start:.1f} s)"


def plain_backbone(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The backbone without accelerate's or torch.compile's wrappers."""
    unwrapped = accelerator.unwrap_model(model)
    return getattr(unwrapped, "_orig_mod", unwrapped)


def fused_adamw(device: torch.device) -> bool | None:
    """`torch.optim.AdamW`'s `fused` on `device`: True on the CPU and CUDA, else None (torch's)."""
    return True if device.type in ("cpu", "cuda") else None


def follow_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """After `load_state_dict`: `fused_adamw`'s kernel for `device`, the step counts where it reads them."""
    fused = fused_adamw(device)
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = fused, None
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if "step" in state and not group["capturable"]:
                state["step"] = state["step"].to(device=param.device if fused else "cpu", dtype=torch.float32)
