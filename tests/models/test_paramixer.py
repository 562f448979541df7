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


def reference_mlp(state: dict, prefix: str, kind: str, x: torch.Tensor, axis: str) -> torch.Tensor:
    """The paper's MLP along `axis` ("l": tokens, "d": channels) of x (B, L, D), from the raw weights."""
    other = "d" if axis == "l" else "l"
    if kind == "vanilla":
        w1, w2 = state[f"{prefix}.fc1.weight"], state[f"{prefix}.fc2.weight"]  # (h, n), (n, h)
    else:
        w1 = state[f"{prefix}.weight"]  # (h, n); W2 = W1ᵀ
        w2 = w1.t()
    hidden = gelu(torch.einsum(f"bld,h{axis}->bh{other}", x, w1))  # hidden units per position of the other axis
    out = torch.einsum(f"bh{other},{axis}h->bld", hidden, w2)
    if kind == "asymmetric":
        out = out + torch.einsum(f"bh{other},{axis}h->bld", hidden, state[f"{prefix}.fc2.weight"])
    return out


MLP_KEYS = {"vanilla": ["fc1.weight", "fc2.weight"], "symmetric": ["weight"], "asymmetric": ["weight", "fc2.weight"]}


def reference_block(state: dict, kind: str, x: torch.Tensor, skip, eps: float, num_iterations: int) -> torch.Tensor:
    """Eq. 32 with the symmetric LayerNorm written out, the long skip added at the input."""
    mlp_keys = {f"{branch}.{key}" for branch in ("token_mlp", "channel_mlp") for key in MLP_KEYS[kind]}
    assert set(state) == {"norm.weight", "norm.bias"} | mlp_keys  # bias-free MLPs, one (L, D) LayerNorm
    if skip is not None:
        x = x + skip
    for _ in range(num_iterations):
        mean = x.mean(dim=(1, 2), keepdim=True)
        var = ((x - mean) ** 2).mean(dim=(1, 2), keepdim=True)
        normed = (x - mean) / torch.sqrt(var + eps) * state["norm.weight"] + state["norm.bias"]
        x = (
            x
            + reference_mlp(state, "token_mlp", kind, normed, "l")
            + reference_mlp(state, "channel_mlp", kind, normed, "d")
        )
    return x


@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("with_skip", [False, True])
@pytest.mark.parametrize("kind", MLPS)
def test_block_matches_plain_torch_restatement(kind, with_skip, num_iterations):
    seq_len, hidden_size, eps = 7, 12, 1e-6
    block = ParaMixerBlock(hidden_size, seq_len, 6, 20, MLPS[kind], eps, num_iterations)
    randomize_(block, seed=0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, seq_len, hidden_size, generator=generator)
    skip = torch.randn(3, seq_len, hidden_size, generator=generator) if with_skip else None
    state = {k: v.detach() for k, v in block.state_dict().items()}
    expected = reference_block(state, kind, x, skip, eps, num_iterations)
    torch.testing.assert_close(block(x, skip), expected, rtol=1e-5, atol=1e-5)


def test_iterations_reuse_the_same_weights():
    block = ParaMixerBlock(12, 7, 6, 20, AsymmetricMLP, 1e-6, num_iterations=3)
    randomize_(block, seed=0)
    once = ParaMixerBlock(12, 7, 6, 20, AsymmetricMLP, 1e-6)
    once.load_state_dict(block.state_dict())
    x, skip = torch.randn(2, 7, 12), torch.randn(2, 7, 12)
    torch.testing.assert_close(block(x, skip), once(once(once(x, skip))))


def test_symmetric_layer_norm_normalises_tokens_and_channels_jointly():
    model = ParaMixerTransformer2DModel(**TINY)  # fresh init: LayerNorm weight 1, bias 0
    block = model.stack.mid_block
    assert block.norm.normalized_shape == (22, 32)
    assert block.norm.weight.shape == (22, 32) and block.norm.eps == 1e-6
    # Tokens with different offsets and scales: a per-token LayerNorm would give every token mean 0.
    x = torch.randn(2, 22, 32) * torch.linspace(0.5, 3, 22)[:, None] + torch.linspace(-2, 2, 22)[:, None]
    normed = block.norm(x)
    torch.testing.assert_close(normed.mean(dim=(1, 2)), torch.zeros(2), atol=1e-5, rtol=0)
    torch.testing.assert_close(normed.var(dim=(1, 2), correction=0), torch.ones(2), atol=1e-4, rtol=0)
    assert normed.mean(dim=2).abs().max() > 0.5  # individual tokens keep their offsets
    assert normed.var(dim=2, correction=0).std() > 0.1  # ... and their relative scales


def test_symmetric_mlp_uses_its_weight_and_its_transpose_and_both_give_it_gradient():
    mlp = SymmetricMLP(5, 9)
    randomize_(mlp, seed=0)
    x = torch.randn(4, 5)
    weight = mlp.weight.detach().clone()
    out = mlp(x)
    torch.testing.assert_close(out, gelu(x @ weight.t()) @ weight)
    out.square().sum().backward()
    first = weight.clone().requires_grad_()
    second = weight.clone().requires_grad_()
    (gelu(x @ first.t()) @ second).square().sum().backward()
    assert first.grad.abs().sum() > 0 and second.grad.abs().sum() > 0
    torch.testing.assert_close(mlp.weight.grad, first.grad + second.grad)  # both uses reach W


def test_tied_weights_get_the_linear_init():
    torch.manual_seed(0)
    model = SymMixerTransformer2DModel(**TINY, mlp_ratio=16)
    weight = model.stack.mid_block.channel_mlp.weight  # (512, 32)
    assert abs(weight.mean().item()) < 0.002 and abs(weight.std().item() - 0.02) < 0.002


def test_penalty_is_the_sum_of_squared_frobenius_norms_of_the_symmetry_breaking_weights_and_only_trains_them():
    torch.manual_seed(0)
    model = AsymMixerTransformer2DModel(**TINY)
    breaking = [m.fc2.weight for m in model.modules() if isinstance(m, AsymmetricMLP)]
    assert len(breaking) == 2 * 3  # token and channel MLP of each of the 3 blocks
    penalty = symmetry_breaking_penalty(model)
    assert penalty.shape == () and penalty.dtype == torch.float32
    torch.testing.assert_close(penalty, sum(torch.linalg.matrix_norm(w, ord="fro") ** 2 for w in breaking))
    assert penalty > 0
    penalty.backward()
    for name, parameter in model.named_parameters():
        if name.endswith("_mlp.fc2.weight"):
            torch.testing.assert_close(parameter.grad, 2 * parameter.detach())
        else:
            assert parameter.grad is None, name


@pytest.mark.slow
def test_penalty_sees_through_compile_and_peft_wrappers():
    from peft import LoraConfig, get_peft_model

    model = AsymMixerTransformer2DModel(**TINY)
    expected = symmetry_breaking_penalty(model)
    torch.testing.assert_close(symmetry_breaking_penalty(torch.compile(model)), expected)
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["channel_mlp.fc2"]))
    torch.testing.assert_close(symmetry_breaking_penalty(wrapped), expected)


@pytest.mark.parametrize("family", MODELS)
def test_every_parameter_gets_a_gradient_with_two_iterations(family):  # one iteration: test_models.py
    torch.manual_seed(0)
    model = MODELS[family](**TINY, num_iterations=2)
    out = model(torch.randn(2, 4, 8, 8), torch.randn(2, 5, 16), torch.tensor([10, 900])).sample
    if family != "asymmixer":
        with pytest.raises(ValueError, match="no symmetry-breaking weights.*AsymMixerTransformer2DModel"):
            symmetry_breaking_penalty(model)
    loss = out.square().mean() + (1e-3 * symmetry_breaking_penalty(model) if family == "asymmixer" else 0)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"token_mlp_ratio": 0.01}, "token_mlp_ratio=0.01 gives a token MLP of int"),
        ({"token_mlp_ratio": "half"}, "token_mlp_ratio='half' cannot build"),
        ({"num_iterations": 0}, "num_iterations=0 cannot build"),
        ({"num_iterations": 1.5}, "num_iterations=1.5 cannot build"),
    ],
)
def test_bad_family_config_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        AsymMixerTransformer2DModel(**TINY, **overrides)
