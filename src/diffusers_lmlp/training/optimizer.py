"""Which AdamW kernel a run uses: torch's fused one on the CPU and CUDA, one kernel over every parameter per step.

On the CPU, torch's default AdamW loops over the parameters in Python, about ten small ops per tensor, several
milliseconds a step for the shapes model (docs/training.md). The fused kernel computes the same update to float
rounding (`tests/test_train_optimizer.py` checks it against AdamW written out).

The kernel is a property of the run's device, not of its checkpoints: `torch.optim.Optimizer.load_state_dict` takes
the implementation flags (`fused`, `foreach`) from the saved state, so `follow_device` sets them again after a
resume. A checkpoint written on a GPU then resumes on a CPU, and one written before this choice existed runs fused.
"""

import torch


# Devices where the fused kernel runs and this project runs it: the CPU (tested) and CUDA (torch's fastest AdamW
# there). Elsewhere torch chooses its own implementation.
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def fused_adamw(device: torch.device) -> bool | None:
    """The `fused` argument of `torch.optim.AdamW` for a run on `device`.

    Args:
        device (`torch.device`): The device the model trains on (`accelerator.device`).

    Returns:
        `True` on the CPU and CUDA, else `None` (torch's default implementation).
    """
    return True if device.type in FUSED_ADAMW_DEVICES else None


def follow_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """After `load_state_dict`: use the kernel `fused_adamw` chooses for `device`, whatever the checkpoint's was.

    The fused kernel keeps each parameter's step count as a float32 tensor on the parameter's device, the unfused one
    on the CPU; the counts move where the chosen kernel reads them.

    Args:
        optimizer (`torch.optim.Optimizer`): The run's AdamW (or accelerate's wrapper of it), its state loaded.
        device (`torch.device`): The device the model trains on.
    """
    fused = fused_adamw(device)
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = fused, None
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if "step" in state and not group["capturable"]:
                state["step"] = state["step"].to(device=param.device if fused else "cpu", dtype=torch.float32)
