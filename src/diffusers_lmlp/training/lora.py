"""LoRA fine-tuning of a backbone through PEFT, as diffusers' LoRA training examples do it.

The base weights are frozen and a LoRA adapter is injected into the layers `lora_config` names: by default every
`nn.Linear` of every block, token mixers included (the family's `lora_target_modules` in the registry), plus the
weights a block uses without a Linear (`lora_target_parameters`). The adapter's weights travel in diffusers' LoRA
format (`pytorch_lora_weights.safetensors`, keys `transformer.<module>.lora_A.weight`, the `LoraConfig` in the file's
metadata), so `LMLPPipeline.load_lora_weights` reads what training writes, checkpoints included.
"""

from pathlib import Path

import torch

from ..hub.lora_card import ADAPTER_NAME, adapted_modules, names_in_block
from ..models.families import family_of


# Where a checkpoint keeps the adapter (instead of the whole backbone's `transformer/`).
CHECKPOINT_FOLDER = "transformer_lora"


def require_peft():
    """Import peft, or say how to install it."""
    try:
        import peft
    except ImportError:
        raise SystemExit(
            'error: --lora_rank trains LoRA adapters with peft, which is not installed: pip install "diffusers-lmlp[train]"'
        ) from None
    return peft


def lora_config(
    model: torch.nn.Module, rank: int, alpha: float | None, dropout: float, target_modules: list[str] | None
):
    """The adapter's `LoraConfig`.

    Args:
        model (`torch.nn.Module`): The backbone; its family gives the default targets.
        rank (`int`): The LoRA rank r.
        alpha (`float`, *optional*): LoRA's alpha (the update is scaled by alpha / r); defaults to the rank, as in
            diffusers' LoRA examples.
        dropout (`float`): Dropout on the adapter's input.
        target_modules (`list[str]`, *optional*): Module names (or name suffixes: `left`, `joint_mlp.fc1`) to adapt
            instead of the family's default, which is every `nn.Linear` of every block.

    Raises:
        `SystemExit`: For a family whose blocks have nothing for `target_modules` to name (the SymMixer's tied
            weights are not Linear layers).
    """
    peft = require_peft()
    family = family_of(model)
    if target_modules:
        targets, parameters = list(target_modules), []
    else:
        targets, parameters = family.lora_target_regex, list(family.lora_target_parameters)
    if not targets and not parameters:
        raise SystemExit(f"error: --lora_target_modules: {family.label} blocks have no nn.Linear layer to adapt")
    return peft.LoraConfig(
        r=rank,
        lora_alpha=rank if alpha is None else alpha,
        lora_dropout=dropout,
        init_lora_weights="gaussian",
        target_modules=targets or [],  # [] with parameters only: None would make PEFT look up a model type
        target_parameters=parameters or None,
    )


def add_lora(model: torch.nn.Module, config) -> list[str]:
    """Freeze the backbone and inject the adapter; check that every named target matched a layer.

    Args:
        model (`torch.nn.Module`): The backbone (a `PeftAdapterMixin` model).
        config (`peft.LoraConfig`): From `lora_config`.

    Returns:
        `list[str]`: The names of the adapted modules.

    Raises:
        `SystemExit`: When a name of `--lora_target_modules` matches no layer (PEFT itself refuses only when none
            does), naming the layers there are.
    """
    model.requires_grad_(False)
    linear_names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    if isinstance(config.target_modules, set | list | tuple):
        for target in sorted(config.target_modules):
            if not any(name == target or name.endswith(f".{target}") for name in linear_names):
                raise SystemExit(
                    f"error: --lora_target_modules {target}: no nn.Linear layer of the backbone is named so; its "
                    f"blocks' layers are {', '.join(names_in_block(linear_names))}"
                )
    try:
        model.add_adapter(config, adapter_name=ADAPTER_NAME)
    except ValueError as error:  # PEFT: none of the targets matched
        raise SystemExit(f"error: --lora_target_modules: {error}") from None
    return adapted_modules(model)


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights, keyed as diffusers' LoRA files key them (without the `transformer.` prefix).

    Args:
        model (`torch.nn.Module`): The backbone with the adapter (unwrapped).
    """
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)


def save_adapter(model: torch.nn.Module, folder: Path) -> Path:
    """Write the adapter as `folder/pytorch_lora_weights.safetensors`, in diffusers' LoRA format.

    Args:
        model (`torch.nn.Module`): The backbone with the adapter (unwrapped).
        folder (`Path`): Where to write it.
    """
    from ..pipelines import LMLPPipeline

    LMLPPipeline.save_lora_weights(
        folder,
        transformer_lora_layers=adapter_state_dict(model),
        transformer_lora_adapter_metadata=model.peft_config[ADAPTER_NAME].to_dict(),
    )
    return Path(folder) / "pytorch_lora_weights.safetensors"


def load_adapter(model: torch.nn.Module, folder: Path) -> None:
    """Load a checkpoint's adapter weights into the backbone's adapter, which must have exactly the same layers.

    Args:
        model (`torch.nn.Module`): The backbone with the adapter (unwrapped).
        folder (`Path`): A folder written by `save_adapter`.

    Raises:
        `SystemExit`: When the saved adapter's layers or shapes differ from the backbone's adapter (another
            `--lora_rank` or `--lora_target_modules` than the run that saved it).
    """
    from peft.utils import set_peft_model_state_dict

    from ..pipelines import LMLPPipeline

    saved = LMLPPipeline.lora_state_dict(str(folder))
    saved = {key.removeprefix("transformer."): value for key, value in saved.items()}
    expected = adapter_state_dict(model)
    mismatched = sorted(set(saved) ^ set(expected)) or sorted(
        k for k in expected if saved[k].shape != expected[k].shape
    )
    if mismatched:
        raise SystemExit(
            f"error: the LoRA adapter in {folder} does not fit this run's adapter (e.g. {mismatched[0]}): resume with "
            "the --lora_rank and --lora_target_modules of the run that saved it"
        )
    set_peft_model_state_dict(model, saved, adapter_name=ADAPTER_NAME)
