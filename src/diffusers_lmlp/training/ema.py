"""The EMA of the backbone's weights that the trainer keeps: diffusers' `EMAModel`, each update made in one pass.

diffusers' multi-tensor update computes `shadow - (1 - decay) * (shadow - weight)` with two foreach ops, the first of
which writes a temporary copy of every shadow weight. `torch._foreach_lerp_` computes the same mix,
`shadow + (1 - decay) * (weight - shadow)`, in place in one pass. On the CPU the update is bound by memory, and the
pass it saves is most of its cost (`python benchmarks/trainer_overhead.py`, its EMA row).

Everything else is `EMAModel`'s: the decay schedule, `save_pretrained` / `from_pretrained`, `state_dict`, `copy_to`,
`store` / `restore`; a checkpoint's `transformer_ema/` is the same folder either way. Under DeepSpeed ZeRO-3, and
with `foreach=False`, `EMAModel.step` itself runs (it gathers the sharded weights first).
"""

from collections.abc import Iterable

import torch
from diffusers.training_utils import EMAModel
from transformers.integrations import is_deepspeed_zero3_enabled


class EMAWeights(EMAModel):
    """diffusers' `EMAModel`, its multi-tensor `step` made with one in-place `lerp` per weight.

    Args: those of `EMAModel` (`parameters`, `decay`, `model_cls`, `model_config`, `foreach`, ...).
    """

    @torch.no_grad()
    def step(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Mix the model's current weights into the shadow weights: `shadow ← decay · shadow + (1 − decay) · weight`
        for trained weights, a copy for frozen ones (a LoRA run's backbone), with `decay` from `get_decay`.

        Args:
            parameters (`Iterable[torch.nn.Parameter]`): The model's parameters, in the order the EMA was made with.
        """
        if isinstance(parameters, torch.nn.Module) or not self.foreach or is_deepspeed_zero3_enabled():
            return super().step(parameters)
        parameters = list(parameters)
        self.optimization_step += 1
        self.cur_decay_value = decay = self.get_decay(self.optimization_step)
        trained: tuple[list, list] = ([], [])  # (shadows, weights)
        frozen: tuple[list, list] = ([], [])
        for shadow, weight in zip(self.shadow_params, parameters, strict=True):
            pair = trained if weight.requires_grad else frozen
            pair[0].append(shadow)
            pair[1].append(weight)
        if frozen[0]:
            torch._foreach_copy_(*frozen, non_blocking=True)
        if trained[0]:
            torch._foreach_lerp_(*trained, 1 - decay)
