"""The trainer's AdamW (torch's fused kernel on the CPU and CUDA) and EMA (diffusers' `EMAModel`, multi-tensor),
checked step by step against their updates written out in plain torch."""

import copy

import pytest
import torch
from accelerate import Accelerator
from diffusers.training_utils import EMAModel
from test_train_text_to_image import train_here
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from diffusers_lmlp.models import LMLPTransformer2DModel
from diffusers_lmlp.training import trainer
from diffusers_lmlp.training.arguments import parse_args
from diffusers_lmlp.training.components import add_lora, lora_config
from diffusers_lmlp.training.step import follow_device, fused_adamw, update_ema


def tiny_model() -> LMLPTransformer2DModel:
    torch.manual_seed(0)
    return LMLPTransformer2DModel(
        sample_size=4, patch_size=2, in_channels=4, hidden_size=16, num_layers=2, text_embed_dim=8, text_seq_len=3
    )


def prepared(model: torch.nn.Module):
    """`prepare_optimization` with the shapes preset's arguments and a constant learning rate, on a CPU accelerator."""
    args = parse_args(["--output_dir", "unused", "--use_ema", "--lr_scheduler", "constant", "--lr_warmup_steps", "0"])
    return trainer.prepare_optimization(args, Accelerator(cpu=True), model), args


@pytest.mark.parametrize(
    "device, fused", [("cpu", True), ("cuda", True), ("cuda:1", True), ("mps", None), ("meta", None), ("xpu", None)]
)
def test_adamw_is_fused_on_the_cpu_and_cuda_and_torchs_default_elsewhere(device, fused):
    assert fused_adamw(torch.device(device)) is fused


def reference_adamw(params, grads, moments, step, lr, betas, eps, weight_decay):
    """One AdamW step (torch's documented update), written out per tensor."""
    beta1, beta2 = betas
    updated = []
    for p, g, (m, v) in zip(params, grads, moments):
        p = p * (1 - lr * weight_decay)
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
        updated.append(p - lr * m_hat / (v_hat.sqrt() + eps))
    return updated


def test_the_trainers_fused_adamw_and_foreach_ema_take_the_written_out_updates_on_every_weight():
    model = tiny_model()
    (model, ema, optimizer, lr_scheduler), args = prepared(model)
    [group] = optimizer.param_groups
    assert group["fused"] is True and isinstance(ema, EMAModel) and ema.foreach is True
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(group["params"]) == len(params)  # every trainable weight, none left out
    expected = [p.detach().clone() for p in params]
    shadow = [s.detach().clone() for s in ema.shadow_params]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    generator = torch.Generator().manual_seed(0)
    for step in range(1, 4):
        grads = [torch.randn(p.shape, generator=generator) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        update_ema(ema, list(model.parameters()))
        hyper = (args.learning_rate, (args.adam_beta1, args.adam_beta2), args.adam_epsilon, args.adam_weight_decay)
        expected = reference_adamw(expected, grads, moments, step, *hyper)
        decay = ema.get_decay(ema.optimization_step)
        shadow = [s - (1 - decay) * (s - p) for s, p in zip(shadow, expected)]
        for name_p, p, e in zip([n for n, q in model.named_parameters() if q.requires_grad], params, expected):
            torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6, msg=f"{name_p} at step {step}")
        for s, e in zip(ema.shadow_params, shadow):
            torch.testing.assert_close(s, e, rtol=1e-5, atol=1e-6)


def test_with_lora_the_fused_adamw_holds_the_adapter_alone_and_the_backbone_stays_as_loaded():
    model = tiny_model()
    add_lora(model, lora_config(model, rank=2, alpha=None, dropout=0.0, target_modules=None))
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    (model, ema, optimizer, _), _ = prepared(model)
    adapter = [p for p in model.parameters() if p.requires_grad]
    [group] = optimizer.param_groups
    assert adapter and group["fused"] is True
    assert {id(p) for p in group["params"]} == {id(p) for p in adapter}
    before = [p.detach().clone() for p in adapter]
    for p in adapter:
        p.grad = torch.ones_like(p)
    optimizer.step()
    ema.step(model.parameters())
    assert all(not torch.equal(b, p) for b, p in zip(before, adapter))  # every adapter weight moved
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name


def adamw_steps(fused: bool | None, load: dict | None = None, weights: dict | None = None, device: str = "cpu"):
    """Two AdamW steps of the tiny model: the state after the first and the weights after both; with `load`, the second
    step runs after loading `load` and `weights` into a fresh optimizer and `follow_device(device)`, as a resume does."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.03, fused=fused)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    if load is None:
        optimizer.step()
        saved, saved_weights = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(model.state_dict())
    else:
        model.load_state_dict(weights)
        optimizer.load_state_dict(load)
        follow_device(optimizer, torch.device(device))
        saved, saved_weights = None, None
    optimizer.step()
    return optimizer, saved, saved_weights, model.state_dict()


@pytest.mark.parametrize(
    "saved_by, resumed_on, kernel",
    [(None, "cpu", True), (True, "cpu", True), (True, "mps", None)],
    ids=["unfused-checkpoint-on-cpu", "fused-checkpoint-on-cpu", "fused-checkpoint-without-the-kernel"],
)
def test_a_resumed_run_uses_its_own_devices_kernel_and_continues_exactly(saved_by, resumed_on, kernel):
    """`follow_device` sets the resumed run's own `fused` flag; "mps" stands for a device without the kernel."""
    _, saved, weights, uninterrupted = adamw_steps(saved_by)
    optimizer, *_, resumed = adamw_steps(saved_by, load=saved, weights=weights, device=resumed_on)
    [group] = optimizer.param_groups
    assert group["fused"] is kernel and group["foreach"] is None
    assert all(
        state["step"].dtype == torch.float32 and state["step"].device.type == "cpu"
        for state in optimizer.state.values()
    )
    for name, value in resumed.items():
        torch.testing.assert_close(value, uninterrupted[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
def test_the_trainers_ema_averages_the_weights_of_every_step_also_across_a_validation(workspace):
    """The EMA's weights stay the model's own through a validation (which swaps the EMA weights in and back), against
    diffusers' `EMAModel` stepped per tensor with the weights each optimizer step left."""
    first, stepped = [], []

    def weights_now(optimizer) -> list[torch.Tensor]:  # every weight of the model, in its order (no LoRA here)
        return [p.detach().clone() for group in optimizer.param_groups for p in group["params"]]

    def before_the_first_step(optimizer, args, kwargs) -> None:
        if not first:
            first.append(weights_now(optimizer))

    def after_each_step(optimizer, args, kwargs) -> None:
        stepped.append(weights_now(optimizer))

    hooks = (
        register_optimizer_step_pre_hook(before_the_first_step),
        register_optimizer_step_post_hook(after_each_step),
    )
    try:
        train_here(
            workspace, "ema-run", "--max_train_steps", "4", "--checkpointing_steps", "4", "--use_ema",
            "--validation_prompts", "a red circle", "--validation_steps", "2", "--validation_inference_steps", "2"
        )  # fmt: skip
    finally:
        for hook in hooks:
            hook.remove()
    saved = EMAModel.from_pretrained(
        workspace / "ema-run" / "checkpoint-4" / "transformer_ema", LMLPTransformer2DModel
    )
    assert len(stepped) == saved.optimization_step == 4
    reference = EMAModel([torch.nn.Parameter(w.clone()) for w in first[0]], decay=saved.decay, foreach=False)
    for weights in stepped:
        reference.step([torch.nn.Parameter(w) for w in weights])
    assert len(saved.shadow_params) == len(reference.shadow_params) == len(first[0])
    for mine, expected, start, end in zip(saved.shadow_params, reference.shadow_params, first[0], stepped[-1]):
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-7)
        assert not torch.equal(mine, start) and not torch.equal(mine, end)  # averaged, neither left nor just copied
