"""The mixers against independent re-statements: the IMLP and its cost, MoE-linear attention, Para/Sym/AsymMixer."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from plain_torch import check_block_matches_reference, gelu, layer_norm, randomize_
from test_models import make_inputs, make_model
from torch.utils.flop_counter import FlopCounterMode

from diffusers_lmlp import load_balancing_loss, symmetry_breaking_penalty
from diffusers_lmlp.complexity import complexity
from diffusers_lmlp.models.mixers.channel_mlp import IMLP, AGeLU, JointMLP
from diffusers_lmlp.models.mixers.moe import MoELinearAttention, collect_router_probs
from diffusers_lmlp.models.mixers.paramixer import AsymmetricMLP, ParaMixerBlock, SymmetricMLP, VanillaMLP


def imlp_reference(state, x, num_extra, grid_size):
    """Eq. 5's AMLP, then the DW block (3×3 depthwise tap by tap, channel norm, GELU); extra tokens are 1×1 images."""
    t = x @ state["fc1.weight"].T + state["fc1.bias"]  # x W^d
    agelus = [[state[f"agelu.{i}.{name}"] for name in ("alpha", "beta", "gamma", "theta")] for i in range(2)]
    t = torch.cat([b * gelu(a * t + c) + d for a, b, c, d in agelus], dim=-1)  # AGeLU, AGeLU' (eq. 4): (B, L, C')
    kernel, bias = state["dw_conv.weight"][:, 0], state["dw_conv.bias"]  # (C', 3, 3), (C',)
    grid = F.pad(t[:, num_extra:].unflatten(1, (grid_size, grid_size)), (0, 0, 1, 1, 1, 1))  # (B, g+2, g+2, C')
    taps = [kernel[:, r, c] * grid[:, r : r + grid_size, c : c + grid_size] for r in range(3) for c in range(3)]
    # the time and text tokens: the centre tap only
    out = torch.cat([t[:, :num_extra] * kernel[:, 1, 1], sum(taps).flatten(1, 2)], dim=1) + bias
    out = gelu(layer_norm(out, state["norm.weight"], state["norm.bias"]))
    return out @ state["fc2.weight"].T + state["fc2.bias"]  # W^e


def test_agelu_starts_as_the_exact_gelu_the_imlps_two_train_apart_and_another_layout_is_refused():
    agelu, x = AGeLU(6), 3 * torch.randn(5, 6)
    torch.testing.assert_close(agelu(x), gelu(x), rtol=0, atol=1e-6)
    randomize_(agelu, seed=0)
    assert not torch.allclose(agelu(x), gelu(x), atol=1e-2)
    agelu.init_weights()
    torch.testing.assert_close(agelu(x), gelu(x), rtol=0, atol=1e-6)
    imlp = IMLP(32, 4.0, num_extra_tokens=6, grid_size=4)
    imlp(torch.randn(2, 22, 32)).pow(2).sum().backward()
    for name in ("alpha", "beta", "gamma", "theta"):
        first, second = (getattr(agelu, name) for agelu in imlp.agelu)
        assert torch.equal(first, second) and not torch.allclose(first.grad, second.grad), name
    with pytest.raises(ValueError, match=r"6 time/text tokens and a 4×4 image grid \(22 tokens\), got 23"):
        imlp(torch.randn(1, 23, 32))  # an odd width: test_models.py


@pytest.mark.parametrize(
    ("hidden_size", "mlp_ratio", "num_extra", "grid_size"),
    [(32, 4.0, 6, 4), (32, 2.5, 1, 3), (32, 1.0, 3, 1), (48, 2.5, 78, 3)],
)
def test_imlp_matches_a_restatement_and_its_closed_form_macs(hidden_size, mlp_ratio, num_extra, grid_size):
    imlp = IMLP(hidden_size, mlp_ratio, num_extra_tokens=num_extra, grid_size=grid_size)
    randomize_(imlp, seed=2)
    seq_len, inner = num_extra + grid_size**2, int(hidden_size * mlp_ratio)
    x = torch.randn(2, seq_len, hidden_size)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = imlp(x)
    torch.testing.assert_close(out, imlp_reference(imlp.state_dict(), x, num_extra, grid_size), rtol=1e-5, atol=1e-5)
    # fc1 to C'/2, the 3×3 depthwise convolution on every token, fc2 (AGeLUs, norm and GELU are element-wise)
    assert counter.get_total_flops() == 2 * 2 * seq_len * (hidden_size * inner // 2 + 9 * inner + inner * hidden_size)
    assert (imlp.fc1.out_features, imlp.fc2.in_features) == (inner // 2, inner)  # W^d: C × C'/2, W^e: C' × C
    assert imlp.dw_conv.groups == inner and imlp.dw_conv.kernel_size == (3, 3)


@pytest.mark.parametrize("kind", ["lmlp", "moe_mlp"])
def test_models_build_every_joint_mlp_as_an_imlp_of_their_layout_and_size(kind):
    model = make_model(kind, channel_mlp="imlp")
    blocks = [*model.stack.in_blocks, model.stack.mid_block, *model.stack.out_blocks]
    assert all(isinstance(block.joint_mlp, IMLP) for block in blocks)
    assert {(block.joint_mlp.num_extra_tokens, block.joint_mlp.grid_size) for block in blocks} == {(6, 4)}
    plain = make_model(kind)  # the same model with the transformer MLP differs by the channel MLPs, block by block
    imlps = sum(p.numel() for block in blocks for p in block.joint_mlp.parameters())
    joint_mlps = sum(p.numel() for m in plain.modules() if isinstance(m, JointMLP) for p in m.parameters())
    assert model.num_parameters() - plain.num_parameters() == imlps - joint_mlps
    # 128-wide IMLP: fc1 to 64, the depthwise 3×3 on 128 channels, fc2; the JointMLP: 32 → 128 → 32
    imlp_macs, joint_macs = 22 * (32 * 64 + 9 * 128 + 128 * 32), 22 * 2 * 32 * 128
    assert complexity(model).macs - complexity(plain).macs == 3 * (imlp_macs - joint_macs)


def naive_moe_linear_attention(mixer, x_tok):
    """Eqs. 4–5 read literally: every expert on its head's channels, weighted by the gate."""
    (batch, _, dim), heads, experts = x_tok.shape, mixer.num_heads, mixer.num_experts
    head_dim, out, probs = dim // heads, torch.zeros_like(x_tok), torch.zeros(batch, heads, experts)
    for b in range(batch):
        for h in range(heads):
            channels = slice(h * head_dim, (h + 1) * head_dim)
            z = x_tok[b, :, channels]  # (L, D/H): this head's channels
            # the gate of every channel of the head, averaged (the pseudo-code's .mean(dim=2)), then softmax
            probs[b, h] = g = (z.T @ mixer.gates[h].weight.T + mixer.gates[h].bias).mean(0).softmax(-1)  # (E,)
            for e in range(experts):
                out[b, :, channels] += g[e] * (mixer.expert_weight[h, e] @ z + mixer.expert_bias[h, e][:, None])
    return out, probs


@pytest.mark.parametrize("experts, heads", [(3, 2), (2, 4), (4, 1)])
def test_moe_linear_attention_matches_naive_per_expert_computation(experts, heads):
    mixer = MoELinearAttention(seq_len=11, hidden_size=16, num_experts=experts, num_heads=heads)
    randomize_(mixer, seed=experts * 10 + heads)
    x_tok = torch.randn(3, 11, 16)
    with torch.no_grad():
        with collect_router_probs(mixer) as collected:
            mixed = mixer(x_tok.transpose(1, 2))  # the mixer works on the permuted (B, D, L) layout
        (probs,) = collected
        expected, expected_probs = naive_moe_linear_attention(mixer, x_tok)
    torch.testing.assert_close(probs, expected_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mixed.transpose(1, 2), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(probs[0], probs[1])  # routing is per sample


def test_router_probs_the_balancing_loss_and_that_one_expert_and_head_is_the_lmlp():
    model = make_model("moe_mlp")
    x, ctx, t = torch.randn(2, 4, 8, 8), torch.randn(2, 5, 16), torch.tensor([1, 2])
    plain = model(x, ctx, t)
    sample, probs = model(x, ctx, t, output_router_probs=True, return_dict=False)
    out = model(x, ctx, t, output_router_probs=True)
    assert plain.router_probs is None and out.router_probs.shape == (3, 2, 2, 3)  # (num_blocks, B, H, E)
    torch.testing.assert_close(out.router_probs.sum(-1), torch.ones(3, 2, 2))
    for same in (probs, out.router_probs), (sample, plain.sample):
        torch.testing.assert_close(*same, rtol=0, atol=0)
    (F.mse_loss(out.sample, x) + load_balancing_loss(out.router_probs)).backward()
    assert model.stack.mid_block.left.gates[1].weight.grad.abs().sum() > 0
    uniform = torch.full((2, 5, 1, 4), 0.25)
    assert load_balancing_loss(uniform).item() == pytest.approx(0.01 * math.log(4))  # CV 0, cross-entropy log E
    # One router, usage u = mean over the batch = (0.6, 0.2, 0.2): CV² = (std/mean)², CE = -mean(log u)
    probs = torch.tensor([[[[0.8, 0.1, 0.1]], [[0.4, 0.3, 0.3]]]])  # (1 block, B = 2, 1 head, 3 experts)
    u = torch.tensor([0.6, 0.2, 0.2])
    expected = (u.std(correction=0) / u.mean()) ** 2 - torch.log(u).mean()
    assert load_balancing_loss(probs, weight=1.0).item() == pytest.approx(expected.item(), rel=1e-6)
    assert load_balancing_loss(probs, weight=1.0) > load_balancing_loss(torch.full((1, 2, 1, 3), 1 / 3), weight=1.0)
    with pytest.raises(ValueError, match=r"router_probs must be \(num_blocks, B, H, E\), got shape \(2, 3\)"):
        load_balancing_loss(torch.ones(2, 3))
    # with one expert and one head, the MoE-MLP is the L-MLP
    lmlp = make_model("lmlp")
    randomize_(lmlp, seed=1)
    moe = make_model("moe_mlp", num_experts=1, num_heads=1)
    # The L-MLP's single token matrix in the MoE layout, (1, 1, L, L) and (1, 1, L): the only expert.
    state = {re.sub(r"left\.(weight|bias)$", r"left.expert_\1", k): v for k, v in lmlp.state_dict().items()}
    state = {k: v[None, None] if ".left.expert_" in k else v for k, v in state.items()}
    missing, unexpected = moe.load_state_dict(state, strict=False)
    assert not unexpected and len(missing) == 6 and {key.split(".left.")[1] for key in missing} == {
        "gates.0.weight", "gates.0.bias"}  # fmt: skip
    one = moe(x, ctx, t, output_router_probs=True)  # any gate gives probability 1 to the only expert
    torch.testing.assert_close(one.sample, lmlp(x, ctx, t).sample, rtol=0, atol=0)
    assert torch.equal(one.router_probs, torch.ones(3, 2, 1, 1))
    assert load_balancing_loss(one.router_probs).item() == pytest.approx(0.0, abs=1e-8)  # E = 1


MLPS = {"vanilla": VanillaMLP, "symmetric": SymmetricMLP, "asymmetric": AsymmetricMLP}
MLP_KEYS = {"vanilla": ["fc1.weight", "fc2.weight"], "symmetric": ["weight"], "asymmetric": ["weight", "fc2.weight"]}


def reference_mlp(state, prefix, kind, x, axis):
    """The paper's MLP along `axis` ("l": tokens, "d": channels) of x (B, L, D), from the raw weights."""
    other = "d" if axis == "l" else "l"
    w1 = state[f"{prefix}.fc1.weight" if kind == "vanilla" else f"{prefix}.weight"]  # (h, n)
    w2 = state[f"{prefix}.fc2.weight"] if kind == "vanilla" else w1.t()  # symmetric: W2 = W1ᵀ
    hidden = F.gelu(torch.einsum(f"bld,h{axis}->bh{other}", x, w1))
    out = torch.einsum(f"bh{other},{axis}h->bld", hidden, w2)
    if kind == "asymmetric":
        out = out + torch.einsum(f"bh{other},{axis}h->bld", hidden, state[f"{prefix}.fc2.weight"])
    return out


@pytest.mark.parametrize("num_iterations", [1, 3])
@pytest.mark.parametrize("with_skip", [False, True])
@pytest.mark.parametrize("kind", MLPS)
def test_block_matches_plain_torch_restatement(kind, with_skip, num_iterations):
    """Eq. 32: one LayerNorm over the whole (L, D) stream, the long skip added at the input, one set of weights."""
    block = ParaMixerBlock(24, 11, 6, 20, MLPS[kind], 1e-6, num_iterations)
    mlp_keys = {f"{branch}.{key}" for branch in ("token_mlp", "channel_mlp") for key in MLP_KEYS[kind]}
    assert set(block.state_dict()) == {"norm.weight", "norm.bias"} | mlp_keys  # bias-free MLPs, one LayerNorm

    def reference(state, x, skip):
        x = x if skip is None else x + skip
        for _ in range(num_iterations):
            n = F.layer_norm(x, (11, 24), state["norm.weight"], state["norm.bias"], eps=1e-6)
            x = x + reference_mlp(state, "token_mlp", kind, n, "l") + reference_mlp(state, "channel_mlp", kind, n, "d")
        return x

    check_block_matches_reference(block, reference, with_skip)


def test_penalty_is_the_sum_of_squared_frobenius_norms_of_the_symmetry_breaking_weights_and_only_trains_them():
    model = make_model("asymmixer")
    breaking = [m.fc2.weight for m in model.modules() if isinstance(m, AsymmetricMLP)]
    assert len(breaking) == 2 * 3  # token and channel MLP of each of the 3 blocks
    penalty = symmetry_breaking_penalty(model)
    assert penalty.shape == () and penalty.dtype == torch.float32 and penalty > 0
    torch.testing.assert_close(penalty, sum(torch.linalg.matrix_norm(w, ord="fro") ** 2 for w in breaking))
    penalty.backward()
    assert [name for name, p in model.named_parameters() if p.grad is not None] == [
        name for name, _ in model.named_parameters() if name.endswith("_mlp.fc2.weight")]  # fmt: skip
    for weight in breaking:
        torch.testing.assert_close(weight.grad, 2 * weight.detach())
    for family in ("paramixer", "symmixer"):
        with pytest.raises(ValueError, match="no symmetry-breaking weights.*AsymMixerTransformer2DModel"):
            symmetry_breaking_penalty(make_model(family))
    # compiled or wrapped by PEFT, the model has the same penalty
    torch.testing.assert_close(symmetry_breaking_penalty(torch.compile(model)), penalty)
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["channel_mlp.fc2"]))
    torch.testing.assert_close(symmetry_breaking_penalty(wrapped), penalty)


@pytest.mark.parametrize("family", ["paramixer", "symmixer", "asymmixer"])
def test_every_parameter_gets_a_gradient_with_two_iterations(family):  # one iteration: test_models.py
    model = make_model(family, num_iterations=2)
    # the symmetric LayerNorm of test_block_matches_plain_torch_restatement
    assert model.stack.mid_block.norm.normalized_shape == (22, 32) and model.stack.mid_block.norm.eps == 1e-6
    model(*make_inputs()).sample.square().mean().backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
