"""Which AdamW kernel a run uses: torch's fused one on the CPU and CUDA (the default loops over the parameters in
Python on the CPU); it computes the same update to float rounding.

The kernel is a property of the run's device, not of its checkpoints: `load_state_dict` takes the `fused`/`foreach`
flags from the saved state, so `follow_device` sets them again after a resume.
"""

import torch


# Devices where the fused kernel is used; elsewhere torch chooses its own implementation.
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def fused_adamw(device: torch.device) -> bool | None:
    """The `fused` argument of `torch.optim.AdamW` for a run on `device`: True on the CPU and CUDA, else None."""
    return True if device.type in FUSED_ADAMW_DEVICES else None


def follow_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """After `load_state_dict`: use the kernel `fused_adamw` chooses for `device`, whatever the checkpoint's was.
    The step counts move where that kernel reads them (the fused one on the parameter's device, else the CPU)."""
    fused = fused_adamw(device)
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = fused, None
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if "step" in state and not group["capturable"]:
                state["step"] = state["step"].to(device=param.device if fused else "cpu", dtype=torch.float32)
