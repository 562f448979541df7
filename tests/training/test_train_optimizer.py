"""The trainer's fused AdamW, multi-tensor EMA and gradient norm (accelerate's; clipped only with --max_grad_norm)."""

import copy
import math

import pytest
import torch
from accelerate import Accelerator
from diffusers.training_utils import EMAModel
from test_train_text_to_image import train_here
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from diffusers_lmlp.models import LMLPTransformer2DModel
from diffusers_lmlp.training import step as step_module
from diffusers_lmlp.training import trainer
from diffusers_lmlp.training.arguments import parse_args
from diffusers_lmlp.training.components import add_lora, lora_config
from diffusers_lmlp.training.step import follow_device, fused_adamw, update_ema


def tiny_model() -> LMLPTransformer2DModel:
    torch.manual_seed(0)
    return LMLPTransformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, hidden_size=16, num_layers=2, text_embed_dim=8, text_seq_len=3
    )


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", "mps", "meta", "xpu"])
def test_adamw_is_fused_on_the_cpu_and_cuda_and_torchs_default_elsewhere(device):
    assert fused_adamw(torch.device(device)) is (True if device.startswith(("cpu", "cuda")) else None)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_trainers_fused_adamw_and_foreach_ema_take_the_written_out_updates_on_every_trained_weight(lora):
    """With LoRA the optimizer holds the adapter alone, and the backbone stays as loaded."""
    model = tiny_model()
    if lora:
        add_lora(model, lora_config(model, rank=2, alpha=None, dropout=0.0, target_modules=None))
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    args = parse_args(["--output_dir", "unused", "--use_ema", "--lr_scheduler", "constant", "--lr_warmup_steps", "0"])
    model, ema, optimizer, lr_scheduler = trainer.prepare_optimization(args, Accelerator(cpu=True), model)
    [group] = optimizer.param_groups
    assert group["fused"] is True and isinstance(ema, EMAModel) and ema.foreach is True
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    assert [id(p) for p in group["params"]] == [id(p) for _, p in named] and bool(frozen) == lora
    expected, shadow = [p.detach().clone() for _, p in named], [s.detach().clone() for s in ema.shadow_params]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in expected]
    lr, beta1, beta2, eps = args.learning_rate, args.adam_beta1, args.adam_beta2, args.adam_epsilon
    generator = torch.Generator().manual_seed(0)
    for step in range(1, 4):
        grads = [torch.randn(p.shape, generator=generator) for p in expected]
        for (_, p), g in zip(named, grads):
            p.grad = g.clone()
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        update_ema(ema, model)
        for i, (g, (m, v)) in enumerate(zip(grads, moments)):  # torch's documented AdamW update
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
            expected[i] = expected[i] * (1 - lr * args.adam_weight_decay) - lr * m_hat / (v_hat.sqrt() + eps)
        for (name, p), e in zip(named, expected):
            torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6, msg=f"{name} at step {step}")
        if not lora:  # the EMA of every weight
            decay = ema.get_decay(ema.optimization_step)
            shadow = [s - (1 - decay) * (s - p) for s, p in zip(shadow, expected)]
            for s, e in zip(ema.shadow_params, shadow):
                torch.testing.assert_close(s, e, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(p, frozen[name]) for name, p in model.named_parameters() if name in frozen)


@pytest.mark.parametrize(
    "saved_by, resumed_on, kernel",
    [(None, "cpu", True), (True, "cpu", True), (True, "mps", None)],
    ids=["unfused-checkpoint-on-cpu", "fused-checkpoint-on-cpu", "fused-checkpoint-without-the-kernel"],
)
def test_a_resumed_run_uses_its_own_devices_kernel_and_continues_exactly(saved_by, resumed_on, kernel):
    """Two AdamW steps, the second after a resume: the run's own `fused` flag ("mps": a device without the kernel)."""
    ends, saved = [], {}
    for resumed in (False, True):
        model = tiny_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.03, fused=saved_by)
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        if resumed:  # a fresh optimizer loads the state the first step left
            model.load_state_dict(saved["weights"])
            optimizer.load_state_dict(saved["state"])
            follow_device(optimizer, torch.device(resumed_on))
        else:
            optimizer.step()
            saved = copy.deepcopy({"state": optimizer.state_dict(), "weights": model.state_dict()})
        optimizer.step()
        ends.append(model.state_dict())
    assert optimizer.param_groups[0]["fused"] is kernel and optimizer.param_groups[0]["foreach"] is None
    assert all(s["step"].dtype == torch.float32 and s["step"].device.type == "cpu" for s in optimizer.state.values())
    for name, value in ends[1].items():
        torch.testing.assert_close(value, ends[0][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_the_trainers_ema_averages_the_weights_of_every_step_also_across_a_validation(workspace):
    """Through a validation (which swaps the EMA weights in and back), against a per-tensor `EMAModel` of each step."""
    before, after = [], []

    def recorder(into: list):  # every weight of the model, in its order (no LoRA here)
        return lambda optimizer, *_: into.append([p.detach().clone() for p in optimizer.param_groups[0]["params"]])

    hooks = [register_optimizer_step_pre_hook(recorder(before)), register_optimizer_step_post_hook(recorder(after))]
    try:
        train_here(
            workspace, "ema-run", "--max_train_steps", "4", "--checkpointing_steps", "4", "--use_ema",
            "--validation_prompts", "a red circle", "--validation_steps", "2", "--validation_inference_steps", "2"
        )  # fmt: skip
    finally:
        for hook in hooks:
            hook.remove()
    saved = EMAModel.from_pretrained(workspace / "ema-run/checkpoint-4/transformer_ema", LMLPTransformer2DModel)
    assert len(after) == saved.optimization_step == 4
    reference = EMAModel([torch.nn.Parameter(w.clone()) for w in before[0]], decay=saved.decay, foreach=False)
    for weights in after:
        reference.step([torch.nn.Parameter(w) for w in weights])
    assert len(saved.shadow_params) == len(reference.shadow_params) == len(before[0])
    for mine, expected, start, end in zip(saved.shadow_params, reference.shadow_params, before[0], after[-1]):
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-7)
        assert not torch.equal(mine, start) and not torch.equal(mine, end)  # averaged, neither left nor just copied


def model_with_gradients(lora: bool = False) -> torch.nn.Module:
    model = tiny_model()  # seeded: every call gives the same weights and gradients
    if lora:  # only the adapter is trained: the backbone's weights have no gradient
        add_lora(model, lora_config(model, rank=2, alpha=None, dropout=0.0, target_modules=None))
    for p in model.parameters():
        p.grad = torch.randn_like(p) if p.requires_grad else None
    return model


def norm_of(model: torch.nn.Module, max_grad_norm=None) -> torch.Tensor:
    return step_module.gradient_norm(Accelerator(cpu=True), model, max_grad_norm)


@pytest.mark.parametrize("max_grad_norm, lora", [(None, False), (0.5, False), (None, True)])
def test_the_norm_is_accelerates_before_clipping_and_the_gradients_change_only_when_clipped(max_grad_norm, lora):
    model = model_with_gradients(lora)
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert 0 < len(before) < len(list(model.parameters())) if lora else len(before) == len(list(model.parameters()))
    norm = norm_of(model, max_grad_norm=max_grad_norm)
    assert torch.equal(
        norm, Accelerator(cpu=True).clip_grad_norm_(model_with_gradients(lora).parameters(), math.inf)
    )  # bit for bit: the same two ops, over the whole model
    assert float(norm) == pytest.approx(float(torch.sqrt(sum((g.double() ** 2).sum() for g in before))), rel=1e-6)
    after = [p.grad for p in model.parameters() if p.grad is not None]
    clipped = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in after])))
    assert all(map(torch.equal, after, before)) if max_grad_norm is None else clipped == pytest.approx(0.5, rel=1e-4)


def test_a_nan_gradient_gives_a_nan_norm_and_no_gradient_a_zero_norm():
    model = model_with_gradients()
    next(model.parameters()).grad[0] = float("nan")
    assert torch.isnan(norm_of(model))
    model.zero_grad(set_to_none=True)
    assert float(norm_of(model)) == 0.0
