"""MoE-linear attention: the E = H = 1 invariant, an independent naive re-statement, and the balancing loss."""

import math

import pytest
import torch
import torch.nn.functional as F
from plain_torch import TINY, randomize_

from diffusers_lmlp import LMLPTransformer2DModel, MoEMLPModel, load_balancing_loss
from diffusers_lmlp.models.mixers.moe import MoELinearAttention, collect_router_probs


def lmlp_to_moe_state_dict(state_dict):
    """L-MLP weights in the MoE layout with E = H = 1: the single matrix becomes the only expert."""
    out = dict(state_dict)
    for key in [key for key in out if key.endswith(("left.weight", "left.bias"))]:
        out[key.replace("left.", "left.expert_")] = out.pop(key)[None, None]  # (1, 1, L, L) and (1, 1, L)
    return out


def test_moe_with_one_expert_and_one_head_equals_the_lmlp():
    lmlp = LMLPTransformer2DModel(**TINY).eval()
    randomize_(lmlp, seed=1)
    moe = MoEMLPModel(**TINY, num_experts=1, num_heads=1).eval()
    missing, unexpected = moe.load_state_dict(lmlp_to_moe_state_dict(lmlp.state_dict()), strict=False)
    assert not unexpected and len(missing) == 6 and {key.split(".left.")[1] for key in missing} == {
        "gates.0.weight", "gates.0.bias"}  # fmt: skip
    x, ctx, t = torch.randn(2, 4, 8, 8), torch.randn(2, 5, 16), torch.tensor([10, 900])
    with torch.no_grad():  # any gate gives probability 1 to the only expert
        out = moe(x, ctx, t, output_router_probs=True)
        torch.testing.assert_close(out.sample, lmlp(x, ctx, t).sample, rtol=0, atol=0)
    assert torch.equal(out.router_probs, torch.ones(3, 2, 1, 1))


def naive_moe_linear_attention(mixer, x_tok):
    """Eqs. 4–5 read literally: every expert applied to its head's channels, outputs weighted by the gate."""
    batch, seq_len, dim = x_tok.shape
    heads, experts = mixer.num_heads, mixer.num_experts
    head_dim = dim // heads
    out = torch.zeros_like(x_tok)
    probs = torch.zeros(batch, heads, experts)
    for b in range(batch):
        for h in range(heads):
            channels = slice(h * head_dim, (h + 1) * head_dim)
            z = x_tok[b, :, channels]  # (L, D/H): this head's channels
            # the gate of every channel of the head, averaged (the pseudo-code's .mean(dim=2)), then softmax
            logits = (z.T @ mixer.gates[h].weight.T + mixer.gates[h].bias).mean(0)  # (E,)
            g = logits.softmax(-1)
            probs[b, h] = g
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


def test_router_probs_output_and_the_balancing_loss_trains_the_gates():
    model = MoEMLPModel(**TINY, num_experts=3, num_heads=2).eval()
    x, ctx, t = torch.randn(2, 4, 8, 8), torch.randn(2, 5, 16), torch.tensor([1, 2])
    with torch.no_grad():
        plain = model(x, ctx, t)
        sample, probs = model(x, ctx, t, output_router_probs=True, return_dict=False)
    out = model(x, ctx, t, output_router_probs=True)
    assert plain.router_probs is None
    assert out.router_probs.shape == (3, 2, 2, 3)  # (num_blocks, B, H, E)
    torch.testing.assert_close(out.router_probs.sum(-1), torch.ones(3, 2, 2))
    torch.testing.assert_close(probs, out.router_probs, rtol=0, atol=0)
    torch.testing.assert_close(sample, plain.sample, rtol=0, atol=0)
    (F.mse_loss(out.sample, x) + load_balancing_loss(out.router_probs)).backward()
    gate = model.stack.mid_block.left.gates[1].weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0


def test_load_balancing_loss_values():
    uniform = torch.full((2, 5, 1, 4), 0.25)
    assert load_balancing_loss(uniform).item() == pytest.approx(0.01 * math.log(4))  # CV 0, cross-entropy log E
    # One router, usage u = mean over the batch = (0.6, 0.2, 0.2): CV² = (std/mean)², CE = -mean(log u)
    probs = torch.tensor([[[[0.8, 0.1, 0.1]], [[0.4, 0.3, 0.3]]]])  # (1 block, B = 2, 1 head, 3 experts)
    u = torch.tensor([0.6, 0.2, 0.2])
    expected = (u.std(correction=0) / u.mean()) ** 2 - torch.log(u).mean()
    assert load_balancing_loss(probs, weight=1.0).item() == pytest.approx(expected.item(), rel=1e-6)
    assert load_balancing_loss(probs, weight=1.0) > load_balancing_loss(torch.full((1, 2, 1, 3), 1 / 3), weight=1.0)
    assert load_balancing_loss(torch.ones(3, 2, 1, 1)).item() == pytest.approx(0.0, abs=1e-8)  # E = 1
    with pytest.raises(ValueError, match=r"router_probs must be \(num_blocks, B, H, E\), got shape \(2, 3\)"):
        load_balancing_loss(torch.ones(2, 3))
