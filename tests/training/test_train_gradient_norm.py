"""The step's gradient norm: accelerate's `clip_grad_norm_` value (LoRA included), the gradients untouched without
`--max_grad_norm` and clipped with it; a NaN gradient gives a NaN norm, never a finite one."""

import math

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from test_train_optimizer import tiny_model

from diffusers_lmlp.training.components import add_lora, lora_config
from diffusers_lmlp.training.step import ACCELERATE_HELD_GRADIENTS, gradient_norm


def model_with_gradients() -> torch.nn.Module:
    model = tiny_model()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    """As the trainer builds it, over every weight that requires a gradient."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])


def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def test_without_clipping_the_norm_is_accelerates_and_the_gradients_are_untouched():
    accelerator = Accelerator(cpu=True)
    model, reference = model_with_gradients(), model_with_gradients()
    before = gradients(model)
    norm = gradient_norm(accelerator, model, optimizer_of(model), max_grad_norm=None)
    expected = accelerator.clip_grad_norm_(reference.parameters(), math.inf)
    assert torch.equal(norm, expected)  # bit for bit: the same two ops
    written_out = torch.sqrt(sum((g.double() ** 2).sum() for g in before))
    assert float(norm) == pytest.approx(float(written_out), rel=1e-6)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))


def test_with_clipping_accelerate_clips_to_the_norm_and_the_norm_before_is_returned():
    accelerator = Accelerator(cpu=True)
    model = model_with_gradients()
    before = torch.linalg.vector_norm(torch.stack([g.norm() for g in gradients(model)]))
    assert before > 0.5
    norm = gradient_norm(accelerator, model, optimizer_of(model), max_grad_norm=0.5)
    assert float(norm) == pytest.approx(float(before), rel=1e-6)  # measured before clipping
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert float(after) == pytest.approx(0.5, rel=1e-4)


def test_a_nan_gradient_gives_a_nan_norm_and_no_gradient_a_zero_norm():
    model = model_with_gradients()
    next(model.parameters()).grad[0] = float("nan")
    assert torch.isnan(gradient_norm(Accelerator(cpu=True), model, optimizer_of(model), max_grad_norm=None))
    for p in model.parameters():
        p.grad = None
    assert float(gradient_norm(Accelerator(cpu=True), model, optimizer_of(model), max_grad_norm=None)) == 0.0


class SpyAccelerator:
    """An accelerator of another distributed type, recording the step's calls."""

    def __init__(self, distributed_type):
        self.distributed_type, self.calls = distributed_type, []

    def clip_grad_norm_(self, parameters, max_norm):
        self.calls.append(("clip_grad_norm_", max_norm))
        return torch.tensor(1.0)

    def unscale_gradients(self):
        self.calls.append(("unscale_gradients",))


@pytest.mark.parametrize(
    "distributed_type",
    [*ACCELERATE_HELD_GRADIENTS, DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU],
)
def test_accelerate_measures_the_gradients_it_holds_or_shards_and_plain_or_ddp_ones_are_measured_in_place(
    distributed_type,
):
    accelerator = SpyAccelerator(distributed_type)
    model = model_with_gradients()
    norm = gradient_norm(accelerator, model, optimizer_of(model), max_grad_norm=None)
    if distributed_type in ACCELERATE_HELD_GRADIENTS:
        assert accelerator.calls == [("clip_grad_norm_", math.inf)]
    else:
        assert accelerator.calls == [("unscale_gradients",)]  # fp16's loss scale is taken out first
        assert torch.equal(norm, Accelerator(cpu=True).clip_grad_norm_(model.parameters(), math.inf))


def test_with_lora_the_norm_is_the_adapters_as_accelerate_measures_it_over_the_whole_model():
    model = model_with_gradients()
    add_lora(model, lora_config(model, rank=2, alpha=None, dropout=0.0, target_modules=None))
    model.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(2)
    adapter = [p for p in model.parameters() if p.requires_grad]
    for p in adapter:
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer = optimizer_of(model)
    assert 0 < len(adapter) < len(list(model.parameters()))
    norm = gradient_norm(Accelerator(cpu=True), model, optimizer, max_grad_norm=None)
    assert torch.equal(norm, Accelerator(cpu=True).clip_grad_norm_(model.parameters(), math.inf))
