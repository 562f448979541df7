"""Every layer is called as a module, so PEFT LoRA adapters and forward hooks see all of them."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig
from test_models import MODELS, make_inputs, make_model
from torch import nn

from diffusers_lmlp.models.mixers.lmlp import LMLPBlock


# The nn.Linear layers of one block as the papers name them; the MoE-MLP block has one L→E gate per head in place of
# `left` (its expert matrices are mixed per sample: parameters, not Linear layers).
PAPER_LINEARS = {
    "lmlp": {"left", "right", "merge", "joint_mlp.fc1", "joint_mlp.fc2"},
    "moe_mlp": {"left.gates.0", "left.gates.1", "right", "merge", "joint_mlp.fc1", "joint_mlp.fc2"},
    "uvit": {"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"},  # and each out block's skip_linear
}


def block_targets(model: nn.Module) -> tuple[list[str], list[str]]:
    """The mid and an out block's nn.Linear layers (`target_modules`) and 2-D weights used without one (tied,
    `target_parameters`), by name inside a block."""
    modules, parameters = set(), set()
    for block in model.stack.mid_block, model.stack.out_blocks[0]:
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear):
                modules.add(name)
            elif not isinstance(module, nn.LayerNorm):
                parameters |= {f"{name}.{key}" for key, p in module.named_parameters(recurse=False) if p.ndim == 2}
    return sorted(modules), sorted(parameters)


BLOCK_TARGETS = {kind: block_targets(make()) for kind, make in MODELS.items()}


def lora_config(targets: list[str], parameters: list[str] = ()) -> LoraConfig:
    # init_lora_weights=False draws lora_B at random too, so a fresh adapter already changes the output.
    return LoraConfig(
        r=2, lora_alpha=2, target_modules=targets, target_parameters=list(parameters), init_lora_weights=False
    )


@pytest.mark.parametrize("kind", PAPER_LINEARS)
def test_every_linear_of_a_block_is_an_nn_linear(kind):
    block = make_model(kind).stack.mid_block
    assert {name for name, module in block.named_modules() if isinstance(module, nn.Linear)} == PAPER_LINEARS[kind]


@pytest.mark.parametrize("kind", MODELS)
def test_lora_on_every_linear_of_every_block_trains(kind):
    model = make_model(kind).train()
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("stack.")]
    modules, parameters = BLOCK_TARGETS[kind]
    model.add_adapter(lora_config(modules, parameters))  # name suffixes: every block
    lora = {name: p for name, p in model.named_parameters() if "lora_" in name}
    tied = len(parameters) * (2 * len(model.stack.in_blocks) + 1)
    assert len(lora) == 2 * (len(linears) + tied)  # lora_A and lora_B of every Linear and tied weight, every block
    assert all(p.requires_grad == (name in lora) for name, p in model.named_parameters())  # the base is frozen
    x, ctx, t = make_inputs()
    (model(x, ctx, t).sample - x).pow(2).mean().backward()
    assert not [name for name, p in lora.items() if p.grad is None or p.grad.abs().sum() == 0]


@pytest.mark.parametrize("kind", MODELS)
def test_an_adapter_saves_loads_and_disables_to_the_base_output(kind, tmp_path):
    model, inputs = make_model(kind), make_inputs()
    with torch.no_grad():
        base = model(*inputs).sample
        model.add_adapter(lora_config(*BLOCK_TARGETS[kind]))
        adapted = model(*inputs).sample
        model.save_lora_adapter(tmp_path)
        assert [p.name for p in tmp_path.iterdir()] == ["pytorch_lora_weights.safetensors"]
        fresh = make_model(kind)
        fresh.load_lora_adapter(tmp_path, prefix=None, use_safetensors=True)
        torch.testing.assert_close(fresh(*inputs).sample, adapted, rtol=0, atol=0)
        model.disable_adapters()
        torch.testing.assert_close(model(*inputs).sample, base, rtol=0, atol=0)
    assert not torch.allclose(adapted, base)


@pytest.mark.parametrize("kind", MODELS)
def test_forward_hooks_fire_on_every_module(kind):
    model, calls = make_model(kind), Counter()
    # Containers are not called, their members are.
    names = {module: name for name, module in model.named_modules() if name and not isinstance(module, nn.ModuleList)}
    for module in names:
        module.register_forward_hook(lambda module, args, output: calls.update([names[module]]))
    with torch.no_grad():
        model(*make_inputs())
    # The L-MLP reference's norm1 is applied twice per block (before the mixers and before the joint MLP).
    twice = {f"{name}.channel_norm" for name, module in model.named_modules() if isinstance(module, LMLPBlock)}
    assert calls == {name: 2 if name in twice else 1 for name in names.values()}


def test_lora_on_a_tied_weight_adapts_both_of_its_uses():
    """SymMixer's MLP uses W twice (GELU(x Wᵀ) W): a LoRA on W changes both uses."""
    model = make_model("symmixer")
    base = model.stack.mid_block.channel_mlp.weight.detach().clone()  # (hidden, D)
    model.add_adapter(lora_config([], ["channel_mlp.weight"]))
    parameters = dict(model.named_parameters())
    lora_a, lora_b = (parameters[f"stack.mid_block.channel_mlp.lora_{x}.default.weight"] for x in "AB")
    adapted = base + lora_b @ lora_a  # lora_alpha / r = 1
    x = torch.randn(3, base.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.stack.mid_block.channel_mlp(x)
        torch.testing.assert_close(out, F.gelu(x @ adapted.t()) @ adapted, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(out, F.gelu(x @ adapted.t()) @ base, atol=1e-6)  # not the first use only
        assert not torch.allclose(out, F.gelu(x @ base.t()) @ adapted, atol=1e-6)  # nor the second only
