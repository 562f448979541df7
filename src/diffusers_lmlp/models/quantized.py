"""A backbone under torch's dynamic int8 quantization (`torch.ao.quantization.quantize_dynamic`): the layers it
replaced, and what they need.

Those layers quantize a float32 input on every call, so the rest of the model must stay float32: after
`.to(torch.bfloat16)` the first one fails inside torch. PEFT cannot adapt them either.
"""

import torch
from torch import nn

from .loading import listed


# Where torch keeps the layers that `quantize_dynamic` puts in place of nn.Linear (and of RNN cells).
DYNAMIC_QUANTIZED_MODULES = "torch.ao.nn.quantized.dynamic"


def is_dynamically_quantized(module: nn.Module) -> bool:
    """Whether `module` is a layer that torch's dynamic quantization put in place of a float one."""
    return type(module).__module__.startswith(DYNAMIC_QUANTIZED_MODULES)


def dynamically_quantized_layers(model: nn.Module) -> list[str]:
    """The names of the layers of `model` that torch's dynamic quantization replaced, in the model's order."""
    return [name for name, module in model.named_modules() if is_dynamically_quantized(module)]


def check_float32_beside_quantized_layers(model: nn.Module) -> None:
    """Raise a `ValueError` when `model` holds dynamically quantized layers and float weights in another dtype than
    float32 (`model.dtype`): they would hand the quantized layers inputs they cannot take."""
    if model.dtype == torch.float32:
        return
    layers = dynamically_quantized_layers(model)
    if layers:
        raise ValueError(
            f"{type(model).__name__} has Linear layers that torch's dynamic quantization replaced ({listed(layers)}), "
            f"which compute on float32 inputs, but its other weights are {model.dtype}. Cast it back with "
            ".to(torch.float32) (the int8 layers keep their weights), or sample the float model in bf16 instead."
        )
