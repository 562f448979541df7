"""The IMLP channel MLP (AGeLU eq. 4, AMLP eq. 5, DW block §4.3) against a re-statement, its cost, in both backbones."""

import pytest
import torch
from plain_torch import TINY, gelu, randomize_
from test_models import make_model
from torch.utils.flop_counter import FlopCounterMode

from diffusers_lmlp import LMLPTransformer2DModel, MoEMLPModel
from diffusers_lmlp.complexity import complexity
from diffusers_lmlp.models.mixers.channel_mlp import CHANNEL_MLPS, IMLP, AGeLU, JointMLP


def imlp_reference(state, x, num_extra, grid_size, eps=1e-5):
    """Eq. 5's AMLP, then the DW block (3×3 depthwise tap by tap, channel norm, GELU); extra tokens are 1×1 images."""
    t = x @ state["fc1.weight"].T + state["fc1.bias"]  # x W^d
    halves = []
    for i in range(2):  # AGeLU and AGeLU' (eq. 4)
        a, b, c, d = (state[f"agelu.{i}.{name}"] for name in ("alpha", "beta", "gamma", "theta"))
        halves.append(b * gelu(a * t + c) + d)
    t = torch.cat(halves, dim=-1)  # (B, L, C')
    kernel, bias = state["dw_conv.weight"][:, 0], state["dw_conv.bias"]  # (C', 3, 3), (C',)
    out = t * kernel[:, 1, 1] + bias  # the time and text tokens: the centre tap only
    for row in range(grid_size):
        for col in range(grid_size):
            acc = bias.expand_as(t[:, 0]).clone()
            for dr in (-1, 0, 1):
                for dc in (-1, 0, 1):
                    r, c = row + dr, col + dc
                    if 0 <= r < grid_size and 0 <= c < grid_size:
                        acc = acc + kernel[:, dr + 1, dc + 1] * t[:, num_extra + r * grid_size + c]
            out[:, num_extra + row * grid_size + col] = acc
    mean = out.mean(-1, keepdim=True)
    var = out.var(-1, correction=0, keepdim=True)
    out = gelu((out - mean) / torch.sqrt(var + eps) * state["norm.weight"] + state["norm.bias"])
    return out @ state["fc2.weight"].T + state["fc2.bias"]  # W^e


def test_agelu_computes_eq_4_per_channel_and_starts_as_the_exact_gelu_and_the_imlps_two_train_apart():
    agelu = AGeLU(6)
    x = 3 * torch.randn(5, 6)
    torch.testing.assert_close(agelu(x), gelu(x), rtol=0, atol=1e-6)
    randomize_(agelu, seed=0)
    with torch.no_grad():
        agelu.alpha[0] = -2.0  # a negative slope flips the shape (Fig. 3)
        out = agelu(x)
    for c in range(6):
        a, b, g, t = agelu.alpha[c].item(), agelu.beta[c].item(), agelu.gamma[c].item(), agelu.theta[c].item()
        torch.testing.assert_close(out[:, c], b * gelu(a * x[:, c] + g) + t, rtol=0, atol=1e-6)
    agelu.init_weights()
    torch.testing.assert_close(agelu(x), gelu(x), rtol=0, atol=1e-6)
    # The IMLP's two AGeLUs start identical and train apart.
    imlp = IMLP(32, 4.0, num_extra_tokens=6, grid_size=4)
    imlp(torch.randn(2, 22, 32)).pow(2).sum().backward()
    for name in ("alpha", "beta", "gamma", "theta"):
        first, second = (getattr(agelu, name) for agelu in imlp.agelu)
        assert torch.equal(first, second) and not torch.allclose(first.grad, second.grad), name


@pytest.mark.parametrize(
    ("hidden_size", "mlp_ratio", "num_extra", "grid_size"),
    [(32, 4.0, 6, 4), (32, 2.5, 1, 3), (32, 1.0, 3, 1), (48, 2.5, 78, 3)],
)
def test_imlp_matches_an_independent_restatement_and_its_closed_form_macs(
    hidden_size, mlp_ratio, num_extra, grid_size
):
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


def test_imlp_refusals_name_the_problem():
    message = r"int\(34 × 1.5\) = 51 between two AGeLUs of C'/2 channels \(eq. 5\), so C' must be even"
    with pytest.raises(ValueError, match=message):
        IMLP(34, 1.5, num_extra_tokens=6, grid_size=4)
    with pytest.raises(ValueError, match=message):
        LMLPTransformer2DModel(**{**TINY, "hidden_size": 34, "mlp_ratio": 1.5, "channel_mlp": "imlp"})
    with pytest.raises(ValueError, match=r"6 time/text tokens and a 4×4 image grid \(22 tokens\), got 23"):
        IMLP(32, 4.0, num_extra_tokens=6, grid_size=4)(torch.randn(1, 23, 32))
    assert CHANNEL_MLPS["imlp"] is IMLP and CHANNEL_MLPS["mlp"] is JointMLP
    for cls in (LMLPTransformer2DModel, MoEMLPModel):
        with pytest.raises(ValueError, match=r"channel_mlp='agelu' is not a channel MLP; choose one of \['imlp'"):
            cls(**TINY, channel_mlp="agelu")


@pytest.mark.parametrize("kind", ["lmlp", "moe_mlp"])
def test_models_build_every_joint_mlp_as_an_imlp_of_their_layout_and_size(kind):
    model = make_model(kind, channel_mlp="imlp")
    blocks = [*model.stack.in_blocks, model.stack.mid_block, *model.stack.out_blocks]
    assert all(isinstance(block.joint_mlp, IMLP) for block in blocks)
    assert {(block.joint_mlp.num_extra_tokens, block.joint_mlp.grid_size) for block in blocks} == {(6, 4)}
    plain = make_model(kind)  # the same model with the transformer MLP differs by the channel MLPs, block by block
    difference = sum(p.numel() for block in blocks for p in block.joint_mlp.parameters()) - sum(
        p.numel() for m in plain.modules() if isinstance(m, JointMLP) for p in m.parameters()
    )
    assert model.num_parameters() - plain.num_parameters() == difference
    # 128-wide IMLP: fc1 to 64, the depthwise 3×3 on 128 channels, fc2; the JointMLP: 32 → 128 → 32
    imlp_macs, joint_macs = 22 * (32 * 64 + 9 * 128 + 128 * 32), 22 * 2 * 32 * 128
    assert complexity(model).macs - complexity(plain).macs == 3 * (imlp_macs - joint_macs)
