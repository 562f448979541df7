"""The step's gradient norm is accelerate's (LoRA included), clipped only with `--max_grad_norm`; NaN stays NaN."""

import math
from unittest.mock import ANY, Mock, call

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from test_train_optimizer import tiny_model

from diffusers_lmlp.training.components import add_lora, lora_config
from diffusers_lmlp.training.step import ACCELERATE_HELD_GRADIENTS, gradient_norm


def model_with_gradients() -> torch.nn.Module:
    model = tiny_model()  # seeded: every call gives the same weights and gradients
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def norm_of(model: torch.nn.Module, accelerator=None, max_grad_norm=None) -> torch.Tensor:
    """`gradient_norm` with an AdamW over every weight that requires a gradient, as the trainer builds it."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return gradient_norm(accelerator or Accelerator(cpu=True), model, optimizer, max_grad_norm=max_grad_norm)


@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_the_norm_is_accelerates_before_clipping_and_the_gradients_change_only_when_clipped(max_grad_norm):
    model = model_with_gradients()
    before = [p.grad.clone() for p in model.parameters()]
    norm = norm_of(model, max_grad_norm=max_grad_norm)
    assert torch.equal(
        norm, Accelerator(cpu=True).clip_grad_norm_(model_with_gradients().parameters(), math.inf)
    )  # bit for bit: the same two ops
    assert float(norm) == pytest.approx(float(torch.sqrt(sum((g.double() ** 2).sum() for g in before))), rel=1e-6)
    after = [p.grad for p in model.parameters()]
    clipped = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in after])))
    assert all(map(torch.equal, after, before)) if max_grad_norm is None else clipped == pytest.approx(0.5, rel=1e-4)


def test_a_nan_gradient_gives_a_nan_norm_and_no_gradient_a_zero_norm():
    model = model_with_gradients()
    next(model.parameters()).grad[0] = float("nan")
    assert torch.isnan(norm_of(model))
    model.zero_grad(set_to_none=True)
    assert float(norm_of(model)) == 0.0


@pytest.mark.parametrize(
    "distributed_type",
    [*ACCELERATE_HELD_GRADIENTS, DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU],
)
def test_accelerate_measures_the_gradients_it_holds_and_plain_or_ddp_ones_are_measured_in_place(distributed_type):
    model, accelerator = model_with_gradients(), Mock(distributed_type=distributed_type)  # recording its calls
    norm = norm_of(model, accelerator)
    if distributed_type in ACCELERATE_HELD_GRADIENTS:
        assert accelerator.method_calls == [call.clip_grad_norm_(ANY, math.inf)]
    else:
        assert accelerator.method_calls == [call.unscale_gradients()]  # fp16's loss scale is taken out first
        assert torch.equal(norm, Accelerator(cpu=True).clip_grad_norm_(model.parameters(), math.inf))


def test_with_lora_the_norm_is_the_adapters_as_accelerate_measures_it_over_the_whole_model():
    model = tiny_model()
    add_lora(model, lora_config(model, rank=2, alpha=None, dropout=0.0, target_modules=None))
    generator = torch.Generator().manual_seed(2)
    adapter = [p for p in model.parameters() if p.requires_grad]
    for p in adapter:
        p.grad = torch.randn(p.shape, generator=generator)
    assert 0 < len(adapter) < len(list(model.parameters()))
    assert torch.equal(norm_of(model), Accelerator(cpu=True).clip_grad_norm_(model.parameters(), math.inf))
