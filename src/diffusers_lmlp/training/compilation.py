"""Whether a training run compiles its backbone: `--torch_compile auto` (the shapes preset's) compiles it with
inductor where that works and the run is long enough to repay the compilation, and the log says which and why.

Compiling does not replace the modules (hooks and PEFT adapters still act). Validation samples with the plain
backbone, so its sampler's batch sizes trigger no recompilation.
"""

import os
import time

import torch

from .precision import launch_device


# Below this many steps `auto` does not compile: the first compilation would not pay off (with a margin).
AUTO_MIN_STEPS = 1000


def choose_compilation(requested: str | None, max_train_steps: int) -> tuple[str | None, str]:
    """The `dynamo_backend` for the `Accelerator` ("inductor", "no", or None to keep accelerate's) for
    `--torch_compile` `requested`, and the reason as " (…)" to append to the log line, or ""."""
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
    """Compile and run a tiny function with inductor (a CPU needs a C++ compiler, a GPU Triton): the seconds it took,
    and "" or the problem."""
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

    accelerate's `unwrap_model` keeps a whole-model compile's `OptimizedModule` (older versions cannot drop it).
    """
    unwrapped = accelerator.unwrap_model(model)
    return getattr(unwrapped, "_orig_mod", unwrapped)
