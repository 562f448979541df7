"""LoRA fine-tuning of a backbone through PEFT, as diffusers' LoRA training examples do it.

The base weights are frozen and an adapter is injected into the layers `lora_config` names (by default every
`nn.Linear` of every block, token mixers included). The adapter is saved in diffusers' LoRA format, so
`LMLPPipeline.load_lora_weights` reads what training writes, checkpoints included.
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
    """The adapter's `LoraConfig`: `alpha` defaults to the rank, as in diffusers' examples, and `target_modules`
    (names or suffixes) to the family's targets; exits when there is nothing to adapt."""
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
    """Freeze the backbone, inject the adapter and return the adapted modules' names; exits when any named target
    matches no layer (PEFT itself refuses only when none does)."""
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
    """The adapter's weights, keyed as diffusers' LoRA files key them (without the `transformer.` prefix)."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)


def save_adapter(model: torch.nn.Module, folder: Path) -> Path:
    """Write the (unwrapped) model's adapter to `folder/pytorch_lora_weights.safetensors`, in diffusers' format."""
    from ..pipelines import LMLPPipeline

    LMLPPipeline.save_lora_weights(
        folder,
        transformer_lora_layers=adapter_state_dict(model),
        transformer_lora_adapter_metadata=model.peft_config[ADAPTER_NAME].to_dict(),
    )
    return Path(folder) / "pytorch_lora_weights.safetensors"


def load_adapter(model: torch.nn.Module, folder: Path) -> None:
    """Load a `save_adapter` folder into the backbone's adapter; exits when their layers or shapes differ."""
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
