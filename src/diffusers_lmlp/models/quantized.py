"""A backbone under torch's dynamic int8 quantization (`quantize_dynamic`): the layers it replaced, which take float32
inputs only (the rest of the model must stay float32) and which PEFT cannot adapt."""

import torch
from torch import nn

from .loading import listed


# Where torch keeps the layers that `quantize_dynamic` puts in place of nn.Linear.
DYNAMIC_QUANTIZED_MODULES = "torch.ao.nn.quantized.dynamic"


def is_dynamically_quantized(module: nn.Module) -> bool:
    """Whether torch's dynamic quantization put `module` in place of a float layer."""
    return type(module).__module__.startswith(DYNAMIC_QUANTIZED_MODULES)


def dynamically_quantized_layers(model: nn.Module) -> list[str]:
    """The names of the layers of `model` that torch's dynamic quantization replaced."""
    return [name for name, module in model.named_modules() if is_dynamically_quantized(module)]


def check_float32_beside_quantized_layers(model: nn.Module) -> None:
    """Raise a `ValueError` when `model` holds dynamically quantized layers and float weights other than float32."""
    if model.dtype == torch.float32:
        return
    layers = dynamically_quantized_layers(model)
    if layers:
        raise ValueError(
            f"{type(model).__name__} has Linear layers that torch's dynamic quantization replaced ({listed(layers)}), "
            f"which compute on float32 inputs, but its other weights are {model.dtype}. Cast it back with "
            ".to(torch.float32) (the int8 layers keep their weights), or sample the float model in bf16 instead."
        )
