"""Whether a training run compiles its backbone: `--torch_compile auto` (the shapes preset's) compiles it with
inductor where that works and the run is long enough to repay the compilation, and the log says which and why.

Compiling traces the backbone's modules into fused kernels; it does not replace them (hooks and PEFT adapters still
act, `tests/test_compile.py`). On 2 AMD EPYC cores with bf16 autocast the shapes model trains about 1.6× faster
compiled (9.5 → 15 steps/s, docs/shapes-runs.md); the first compilation costs about 20 s, which pays off after
about 550 steps. Validation samples with the plain backbone, so its sampler's batch sizes trigger no recompilation.
"""

import os
import time

import torch

from .precision import launch_device


# Below this many steps `auto` does not compile: ~20 s of compilation against ~0.04 s saved per step on the shapes
# model (break-even near 550 steps), with a margin for larger first compilations on slower machines.
AUTO_MIN_STEPS = 1000


def choose_compilation(requested: str | None, max_train_steps: int) -> tuple[str | None, str]:
    """The `dynamo_backend` to build the `Accelerator` with, and why, for the log.

    Args:
        requested (`str`, *optional*): `--torch_compile` ("yes", "no", "auto"), or None for accelerate's configuration
            (`accelerate launch --dynamo_backend ...`).
        max_train_steps (`int`): The run's optimizer steps, which `auto` weighs against the compilation's cost.

    Returns:
        `tuple[str | None, str]`: The backend ("inductor", "no", or None to keep accelerate's), and the reason as
        " (…)" to append to the log line, or "".
    """
    if requested is None:
        return None, ""
    if requested != "auto":
        return ("inductor" if requested == "yes" else "no"), ""
    launched = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()  # `accelerate launch --dynamo_backend`
    if launched != "no":
        return None, f" (auto: the launch's {launched} is kept)"
    if max_train_steps < AUTO_MIN_STEPS:
        return "no", f" (auto: {max_train_steps} steps do not repay a compilation; --torch_compile yes compiles)"
    seconds, problem = try_compilation(launch_device())
    if problem:
        return "no", f" (auto: torch.compile does not work here, {problem}; training uncompiled)"
    return "inductor", f" (auto: inductor works here, a trial compilation took {seconds:.1f} s)"


def try_compilation(device: str) -> tuple[float, str]:
    """Compile and run a tiny function with inductor: on a CPU that needs a working C++ compiler, on a GPU Triton.

    Args:
        device (`str`): The device to compile for.

    Returns:
        `tuple[float, str]`: The seconds it took, and "" or the problem (the error's type and first line).
    """
    start = time.perf_counter()
    try:
        trial = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2.0 + 1.0, backend="inductor", fullgraph=True)
        trial(torch.linspace(-1.0, 1.0, 16, device=device))
    except Exception as error:  # any failure (no compiler, no Triton, an old Python) means: do not compile
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        return time.perf_counter() - start, f"{type(error).__name__}: {first_line}"
    finally:
        torch._dynamo.reset()  # the trial's cache entries are of no use to the run
    return time.perf_counter() - start, ""


def plain_backbone(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The backbone without accelerate's wrappers or torch.compile's, for saving, sampling and checks.

    accelerate's `unwrap_model` keeps a whole-model compile's `OptimizedModule` (and older accelerate versions have
    no option to drop it); a regional compile compiles the blocks in place, with no wrapper to remove.

    Args:
        accelerator (`Accelerator`): The run's accelerator.
        model (`torch.nn.Module`): The prepared backbone.
    """
    unwrapped = accelerator.unwrap_model(model)
    return getattr(unwrapped, "_orig_mod", unwrapped)
