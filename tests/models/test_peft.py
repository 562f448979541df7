"""Every layer is called as a module, so PEFT LoRA adapters and forward hooks see all of them."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig
from test_lora_loading import block_targets  # a block's Linears and its tied 2-D weights
from test_models import MODELS, make_inputs, make_model
from torch import nn

from diffusers_lmlp.models.mixers.lmlp import LMLPBlock


# One block's nn.Linear layers as the papers name them (the MoE-MLP's experts are parameters, mixed per sample).
PAPER_LINEARS = {
    "lmlp": {"left", "right", "merge", "joint_mlp.fc1", "joint_mlp.fc2"},
    "moe_mlp": {"left.gates.0", "left.gates.1", "right", "merge", "joint_mlp.fc1", "joint_mlp.fc2"},
    "uvit": {"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"},  # and each out block's skip_linear
}


BLOCK_TARGETS = {kind: block_targets(make()) for kind, make in MODELS.items()}


def lora_config(targets: list[str], parameters: list[str] = ()) -> LoraConfig:
    # init_lora_weights=False draws lora_B at random too, so a fresh adapter already changes the output.
    return LoraConfig(
        r=2, lora_alpha=2, target_modules=targets, target_parameters=list(parameters), init_lora_weights=False
    )


@pytest.mark.parametrize("kind", MODELS)
def test_hooks_fire_on_every_module_and_a_lora_on_every_linear_trains_saves_loads_and_disables(kind, tmp_path):
    model, inputs, calls = make_model(kind).train(), make_inputs(), Counter()
    # Containers are not called, their members are.
    names = {module: name for name, module in model.named_modules() if name and not isinstance(module, nn.ModuleList)}
    for module in names:
        module.register_forward_hook(lambda module, args, output: calls.update([names[module]]))
    with torch.no_grad():
        base = model(*inputs).sample
    # The L-MLP reference's norm1 is applied twice per block (before the mixers and before the joint MLP).
    twice = {f"{name}.channel_norm" for name, module in model.named_modules() if isinstance(module, LMLPBlock)}
    assert calls == {name: 2 if name in twice else 1 for name in names.values()}
    linears = {name for name, module in model.stack.mid_block.named_modules() if isinstance(module, nn.Linear)}
    assert linears == PAPER_LINEARS.get(kind, linears)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("stack.")]
    modules, parameters = BLOCK_TARGETS[kind]
    model.add_adapter(lora_config(modules, parameters))  # name suffixes: every block
    lora = {name: p for name, p in model.named_parameters() if "lora_" in name}
    tied = len(parameters) * (2 * len(model.stack.in_blocks) + 1)
    assert len(lora) == 2 * (len(linears) + tied)  # lora_A and lora_B of every Linear and tied weight, every block
    assert all(p.requires_grad == (name in lora) for name, p in model.named_parameters())  # the base is frozen
    ((adapted := model(*inputs).sample) - inputs[0]).pow(2).mean().backward()
    assert not [name for name, p in lora.items() if p.grad is None or p.grad.abs().sum() == 0]
    adapted = adapted.detach()
    with torch.no_grad():
        model.save_lora_adapter(tmp_path)
        assert [p.name for p in tmp_path.iterdir()] == ["pytorch_lora_weights.safetensors"]
        fresh = make_model(kind)
        fresh.load_lora_adapter(tmp_path, prefix=None, use_safetensors=True)
        torch.testing.assert_close(fresh(*inputs).sample, adapted, rtol=0, atol=0)
        model.disable_adapters()
        torch.testing.assert_close(model(*inputs).sample, base, rtol=0, atol=0)
    assert not torch.allclose(adapted, base)


def test_lora_on_a_tied_weight_adapts_both_of_its_uses():
    """SymMixer's MLP uses W twice (GELU(x Wᵀ) W): a LoRA on W changes both uses."""
    model = make_model("symmixer")
    base = model.stack.mid_block.channel_mlp.weight.detach().clone()  # (hidden, D)
    model.add_adapter(lora_config([], ["channel_mlp.weight"]))
    parameters = dict(model.named_parameters())
    lora_a, lora_b = (parameters[f"stack.mid_block.channel_mlp.lora_{x}.default.weight"] for x in "AB")
    adapted = base + lora_b @ lora_a  # lora_alpha / r = 1
    x = torch.randn(3, base.shape[1], generator=torch.Generator().manual_seed(0))
    out = model.stack.mid_block.channel_mlp(x)
    torch.testing.assert_close(out, F.gelu(x @ adapted.t()) @ adapted, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out, F.gelu(x @ adapted.t()) @ base, atol=1e-6)  # not the first use only
    assert not torch.allclose(out, F.gelu(x @ base.t()) @ adapted, atol=1e-6)  # nor the second only
