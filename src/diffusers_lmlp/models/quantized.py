"""A backbone under torch's dynamic int8 quantization (`quantize_dynamic`): the layers it replaced, which take float32
inputs only and which PEFT cannot adapt."""

import torch
from torch import nn

from .loading import listed


def is_dynamically_quantized(module: nn.Module) -> bool:
    """Whether torch's dynamic quantization put `module` in place of a float layer."""
    return type(module).__module__.startswith("torch.ao.nn.quantized.dynamic")


def dynamically_quantized_layers(model: nn.Module) -> list[str]:
    """The names of the layers of `model` that torch's dynamic quantization replaced."""
    return [name for name, module in model.named_modules() if is_dynamically_quantized(module)]


def check_float32_beside_quantized_layers(model: nn.Module) -> None:
    """Raise a `ValueError` when `model` holds dynamically quantized layers and float weights other than float32."""
    layers = dynamically_quantized_layers(model) if model.dtype != torch.float32 else []
    if layers:
        raise ValueError(
            f"{type(model).__name__} has Linear layers that torch's dynamic quantization replaced ({listed(layers)}), "
            f"which compute on float32 inputs, but its other weights are {model.dtype}. Cast it back with "
            ".to(torch.float32), or sample the float model in bf16 instead."
        )
