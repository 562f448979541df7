"""ParaMixer, SymMixer, AsymMixer (Karakida et al. 2024): blocks vs a re-statement, norm, tied weights, penalty."""

import pytest
import torch
from plain_torch import TINY, randomize_
from torch.nn.functional import gelu

from diffusers_lmlp import (
    AsymMixerTransformer2DModel,
    ParaMixerTransformer2DModel,
    SymMixerTransformer2DModel,
    symmetry_breaking_penalty,
)
from diffusers_lmlp.models.mixers.paramixer import AsymmetricMLP, ParaMixerBlock, SymmetricMLP, VanillaMLP


MODELS = {
    "paramixer": ParaMixerTransformer2DModel,
    "symmixer": SymMixerTransformer2DModel,
    "asymmixer": AsymMixerTransformer2DModel,
}
MLPS = {"vanilla": VanillaMLP, "symmetric": SymmetricMLP, "asymmetric": AsymmetricMLP}
MLP_KEYS = {"vanilla": ["fc1.weight", "fc2.weight"], "symmetric": ["weight"], "asymmetric": ["weight", "fc2.weight"]}


def reference_mlp(state, prefix, kind, x, axis):
    """The paper's MLP along `axis` ("l": tokens, "d": channels) of x (B, L, D), from the raw weights."""
    other = "d" if axis == "l" else "l"
    w1 = state[f"{prefix}.fc1.weight" if kind == "vanilla" else f"{prefix}.weight"]  # (h, n)
    w2 = state[f"{prefix}.fc2.weight"] if kind == "vanilla" else w1.t()  # symmetric: W2 = W1ᵀ
    hidden = gelu(torch.einsum(f"bld,h{axis}->bh{other}", x, w1))
    out = torch.einsum(f"bh{other},{axis}h->bld", hidden, w2)
    if kind == "asymmetric":
        out = out + torch.einsum(f"bh{other},{axis}h->bld", hidden, state[f"{prefix}.fc2.weight"])
    return out


@pytest.mark.parametrize("num_iterations", [1, 3])
@pytest.mark.parametrize("with_skip", [False, True])
@pytest.mark.parametrize("kind", MLPS)
def test_block_matches_plain_torch_restatement(kind, with_skip, num_iterations):
    """Eq. 32 with the symmetric LayerNorm written out, the long skip added at the input, one set of weights."""
    eps = 1e-6
    block = ParaMixerBlock(12, 7, 6, 20, MLPS[kind], eps, num_iterations)
    randomize_(block, seed=0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 12, generator=generator)
    skip = torch.randn(3, 7, 12, generator=generator) if with_skip else None
    state = {k: v.detach() for k, v in block.state_dict().items()}
    mlp_keys = {f"{branch}.{key}" for branch in ("token_mlp", "channel_mlp") for key in MLP_KEYS[kind]}
    assert set(state) == {"norm.weight", "norm.bias"} | mlp_keys  # bias-free MLPs, one (L, D) LayerNorm
    expected = x if skip is None else x + skip
    for _ in range(num_iterations):
        mean = expected.mean(dim=(1, 2), keepdim=True)
        var = ((expected - mean) ** 2).mean(dim=(1, 2), keepdim=True)
        normed = (expected - mean) / torch.sqrt(var + eps) * state["norm.weight"] + state["norm.bias"]
        expected = expected + sum(
            reference_mlp(state, f"{b}_mlp", kind, normed, a) for b, a in [("token", "l"), ("channel", "d")]
        )
    torch.testing.assert_close(block(x, skip), expected, rtol=1e-5, atol=1e-5)


def test_symmetric_layer_norm_normalises_tokens_and_channels_jointly():
    block = ParaMixerTransformer2DModel(**TINY).stack.mid_block  # fresh init: LayerNorm weight 1, bias 0
    assert block.norm.normalized_shape == (22, 32) and block.norm.eps == 1e-6
    # Tokens with different offsets and scales: a per-token LayerNorm would give every token mean 0.
    normed = block.norm(
        torch.randn(2, 22, 32) * torch.linspace(0.5, 3, 22)[:, None] + torch.linspace(-2, 2, 22)[:, None]
    )
    torch.testing.assert_close(normed.mean(dim=(1, 2)), torch.zeros(2), atol=1e-5, rtol=0)
    torch.testing.assert_close(normed.var(dim=(1, 2), correction=0), torch.ones(2), atol=1e-4, rtol=0)
    assert normed.mean(dim=2).abs().max() > 0.5 and normed.var(dim=2, correction=0).std() > 0.1  # tokens keep theirs


def test_a_tied_weight_gets_the_linear_init_and_the_gradient_of_both_its_uses():
    torch.manual_seed(0)
    weight = SymMixerTransformer2DModel(**TINY, mlp_ratio=16).stack.mid_block.channel_mlp.weight  # (512, 32)
    assert abs(weight.mean().item()) < 0.002 and abs(weight.std().item() - 0.02) < 0.002
    mlp = SymmetricMLP(5, 9)
    randomize_(mlp, seed=0)
    x, w = torch.randn(4, 5), mlp.weight.detach().clone().requires_grad_()
    mlp(x).square().sum().backward()
    (gelu(x @ w.t()) @ w).square().sum().backward()
    torch.testing.assert_close(mlp.weight.grad, w.grad)  # GELU(x Wᵀ) W through both uses of W


def test_penalty_is_the_sum_of_squared_frobenius_norms_of_the_symmetry_breaking_weights_and_only_trains_them():
    torch.manual_seed(0)
    model = AsymMixerTransformer2DModel(**TINY)
    breaking = [m.fc2.weight for m in model.modules() if isinstance(m, AsymmetricMLP)]
    assert len(breaking) == 2 * 3  # token and channel MLP of each of the 3 blocks
    penalty = symmetry_breaking_penalty(model)
    assert penalty.shape == () and penalty.dtype == torch.float32 and penalty > 0
    torch.testing.assert_close(penalty, sum(torch.linalg.matrix_norm(w, ord="fro") ** 2 for w in breaking))
    penalty.backward()
    for name, parameter in model.named_parameters():
        if name.endswith("_mlp.fc2.weight"):
            torch.testing.assert_close(parameter.grad, 2 * parameter.detach())
        else:
            assert parameter.grad is None, name
    from peft import LoraConfig, get_peft_model

    # compiled or wrapped by PEFT, the model has the same penalty
    torch.testing.assert_close(symmetry_breaking_penalty(torch.compile(model)), penalty)
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["channel_mlp.fc2"]))
    torch.testing.assert_close(symmetry_breaking_penalty(wrapped), penalty)


@pytest.mark.parametrize("family", MODELS)
def test_every_parameter_gets_a_gradient_with_two_iterations(family):  # one iteration: test_models.py
    torch.manual_seed(0)
    model = MODELS[family](**TINY, num_iterations=2)
    loss = model(torch.randn(2, 4, 8, 8), torch.randn(2, 5, 16), torch.tensor([10, 900])).sample.square().mean()
    if family == "asymmixer":
        loss = loss + 1e-3 * symmetry_breaking_penalty(model)
    else:
        with pytest.raises(ValueError, match="no symmetry-breaking weights.*AsymMixerTransformer2DModel"):
            symmetry_breaking_penalty(model)
    loss.backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
