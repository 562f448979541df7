"""The IMLP channel MLP (AGeLU, eq. 4; AMLP, eq. 5; the DW block, §4.3): an independent re-statement, its cost, and
the IMLP plugged into both backbones."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from diffusers_lmlp import LMLPTransformer2DModel, MoEMLPModel
from diffusers_lmlp.complexity import complexity
from diffusers_lmlp.models.mixers.channel_mlp import CHANNEL_MLPS, IMLP, AGeLU, JointMLP


TINY = dict(
    sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, text_embed_dim=16, text_seq_len=5
)
MODELS = {
    "lmlp": lambda **kw: LMLPTransformer2DModel(**{**TINY, "channel_mlp": "imlp", **kw}),
    "moe_mlp": lambda **kw: MoEMLPModel(**{**TINY, "num_experts": 2, "num_heads": 2, "channel_mlp": "imlp", **kw}),
}


@pytest.fixture(params=list(MODELS))
def kind(request):
    return request.param


def make_model(kind, seed=0, **kw):
    torch.manual_seed(seed)
    return MODELS[kind](**kw).eval()


def make_inputs(batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, 4, 8, 8, generator=gen),
        torch.randn(batch, 5, 16, generator=gen),
        torch.randint(0, 1000, (batch,), generator=gen),
    )


def randomize_(module, seed):
    """Random values in every parameter (AGeLU coefficients, biases and norms too), so no term hides behind its init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen) + (1.0 if p.ndim == 1 else 0.0))


def gelu(z):
    """The exact GELU, z·Φ(z)."""
    return 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))


def imlp_reference(state, x, num_extra, grid_size, eps=1e-5):
    """The IMLP read from the paper over a state dict: eq. 5's AMLP, then the DW block (3×3 depthwise convolution
    written out tap by tap, norm over channels, GELU) with each time/text token a zero-padded 1×1 image."""
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


def test_agelu_starts_as_the_exact_gelu():
    x = 3 * torch.randn(4, 7, 10)
    torch.testing.assert_close(AGeLU(10)(x), gelu(x), rtol=0, atol=1e-6)


def test_agelu_computes_eq_4_per_channel():
    agelu = AGeLU(6)
    randomize_(agelu, seed=0)
    with torch.no_grad():
        agelu.alpha[0] = -2.0  # a negative slope flips the shape (Fig. 3)
        x = 3 * torch.randn(5, 6)
        out = agelu(x)
    for c in range(6):
        a, b, g, t = agelu.alpha[c].item(), agelu.beta[c].item(), agelu.gamma[c].item(), agelu.theta[c].item()
        torch.testing.assert_close(out[:, c], b * gelu(a * x[:, c] + g) + t, rtol=0, atol=1e-6)


def test_agelu_init_weights_restores_gelu():
    agelu = AGeLU(5)
    randomize_(agelu, seed=1)
    agelu.init_weights()
    x = torch.randn(3, 5)
    torch.testing.assert_close(agelu(x), gelu(x), rtol=0, atol=1e-6)


@pytest.mark.parametrize(("mlp_ratio", "num_extra", "grid_size"), [(4.0, 6, 4), (2.5, 1, 3), (1.0, 3, 1)])
def test_imlp_matches_an_independent_restatement(mlp_ratio, num_extra, grid_size):
    imlp = IMLP(32, mlp_ratio, num_extra_tokens=num_extra, grid_size=grid_size)
    randomize_(imlp, seed=2)
    x = torch.randn(3, num_extra + grid_size**2, 32)
    with torch.no_grad():
        expected = imlp_reference(imlp.state_dict(), x, num_extra, grid_size)
        torch.testing.assert_close(imlp(x), expected, rtol=1e-5, atol=1e-5)


def test_imlp_first_linear_has_half_the_hidden_width():
    imlp = IMLP(32, 4.0, num_extra_tokens=6, grid_size=4)
    assert (imlp.fc1.in_features, imlp.fc1.out_features) == (32, 64)  # W^d: C × C'/2
    assert (imlp.fc2.in_features, imlp.fc2.out_features) == (128, 32)  # W^e: C' × C
    assert imlp.dw_conv.groups == 128 and imlp.dw_conv.kernel_size == (3, 3)


def test_dw_block_mixes_only_grid_neighbours():
    """A change at one image token reaches its 3×3 neighbourhood on the row-major grid and no other token."""
    imlp = IMLP(32, 4.0, num_extra_tokens=6, grid_size=4).eval()
    randomize_(imlp, seed=3)
    x = torch.randn(1, 22, 32)
    moved = x.clone()
    moved[0, 6 + 1 * 4 + 2] += 1.0  # the image token at row 1, column 2
    with torch.no_grad():
        changed = (imlp(moved) - imlp(x)).abs().amax(-1)[0] > 0  # (L,)
    neighbours = {6 + r * 4 + c for r in (0, 1, 2) for c in (1, 2, 3)}
    assert set(changed.nonzero().flatten().tolist()) == neighbours


def test_two_agelus_start_identical_and_get_different_gradients():
    imlp = IMLP(32, 4.0, num_extra_tokens=6, grid_size=4)
    first, second = imlp.agelu
    for name in ("alpha", "beta", "gamma", "theta"):
        assert torch.equal(getattr(first, name), getattr(second, name))
    imlp(torch.randn(2, 22, 32)).pow(2).sum().backward()
    for name in ("alpha", "beta", "gamma", "theta"):
        assert not torch.allclose(getattr(first, name).grad, getattr(second, name).grad), name


@pytest.mark.parametrize(("hidden_size", "mlp_ratio", "num_extra", "grid_size"), [(32, 4.0, 6, 4), (48, 2.5, 78, 3)])
def test_imlp_macs_are_its_closed_form(hidden_size, mlp_ratio, num_extra, grid_size):
    imlp = IMLP(hidden_size, mlp_ratio, num_extra_tokens=num_extra, grid_size=grid_size)
    seq_len = num_extra + grid_size**2
    inner = int(hidden_size * mlp_ratio)
    # fc1 to C'/2, the 3×3 depthwise convolution on every token, fc2 (AGeLUs, norm and GELU are element-wise)
    macs = seq_len * (hidden_size * inner // 2 + 9 * inner + inner * hidden_size)
    with FlopCounterMode(display=False) as counter:
        imlp(torch.randn(2, seq_len, hidden_size))
    assert counter.get_total_flops() == 2 * 2 * macs


def test_imlp_with_odd_hidden_width_raises_a_clear_error():
    message = r"int\(34 × 1.5\) = 51 between two AGeLUs of C'/2 channels \(eq. 5\), so C' must be even"
    with pytest.raises(ValueError, match=message):
        IMLP(34, 1.5, num_extra_tokens=6, grid_size=4)
    with pytest.raises(ValueError, match=message):
        LMLPTransformer2DModel(**{**TINY, "hidden_size": 34, "mlp_ratio": 1.5, "channel_mlp": "imlp"})


def test_imlp_rejects_a_sequence_of_another_layout():
    imlp = IMLP(32, 4.0, num_extra_tokens=6, grid_size=4)
    with pytest.raises(ValueError, match=r"6 time/text tokens and a 4×4 image grid \(22 tokens\), got 23"):
        imlp(torch.randn(1, 23, 32))


def test_imlp_is_registered_and_unknown_names_raise():
    assert CHANNEL_MLPS["imlp"] is IMLP and CHANNEL_MLPS["mlp"] is JointMLP
    for cls in (LMLPTransformer2DModel, MoEMLPModel):
        with pytest.raises(
            ValueError, match=r"channel_mlp='agelu' is not a channel MLP; choose one of \['imlp', 'mlp'"
        ):
            cls(**TINY, channel_mlp="agelu")


def test_models_build_every_joint_mlp_as_an_imlp_with_their_layout(kind):
    model = make_model(kind)
    blocks = [*model.stack.in_blocks, model.stack.mid_block, *model.stack.out_blocks]
    assert all(isinstance(block.joint_mlp, IMLP) for block in blocks)
    assert {(block.joint_mlp.num_extra_tokens, block.joint_mlp.grid_size) for block in blocks} == {(6, 4)}
    x, ctx, t = make_inputs()
    with torch.no_grad():
        out = model(x, ctx, t).sample
    assert out.shape == (2, 4, 8, 8) and torch.isfinite(out).all()


def test_model_size_and_macs_follow_the_imlp(kind):
    model = make_model(kind)
    imlps = [m for m in model.modules() if isinstance(m, IMLP)]
    assert len(imlps) == 3
    plain = MODELS[kind](channel_mlp="mlp")
    joint_mlps = [m for m in plain.modules() if isinstance(m, JointMLP)]
    # the same model with the transformer MLP differs by exactly the two channel MLPs, block by block
    difference = sum(p.numel() for m in imlps for p in m.parameters()) - sum(
        p.numel() for m in joint_mlps for p in m.parameters()
    )
    assert model.num_parameters() - plain.num_parameters() == difference
    # 128-wide IMLP: fc1 to 64, the depthwise 3×3 on 128 channels, fc2; the JointMLP: 32 → 128 → 32
    imlp_macs, joint_macs = 22 * (32 * 64 + 9 * 128 + 128 * 32), 22 * 2 * 32 * 128
    assert complexity(model).macs - complexity(plain).macs == 3 * (imlp_macs - joint_macs)


def _loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    x, ctx, t = inputs
    loss = (model(x, ctx, t).sample - x).pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_every_parameter_gets_a_gradient(kind):
    model = make_model(kind).train()
    _, grads = _loss_and_grads(model, make_inputs())
    assert set(grads) == {n for n, _ in model.named_parameters()}
    zero = [n for n, g in grads.items() if not torch.isfinite(g).all() or g.abs().sum() == 0]
    assert not zero, f"parameters without gradient signal: {zero}"


@pytest.mark.parametrize("train", [False, True])
def test_batch_consistency(kind, train):
    """Each sample's prediction is its own, in evaluation and in training mode (the DW block's norm is per token)."""
    model = make_model(kind).train(train)
    x, ctx, t = make_inputs(batch=3)
    with torch.no_grad():
        batched = model(x, ctx, t).sample
        singles = torch.cat([model(x[i : i + 1], ctx[i : i + 1], t[i : i + 1]).sample for i in range(3)])
    torch.testing.assert_close(batched, singles, rtol=1e-5, atol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients(kind):
    model = make_model(kind).train()
    inputs = make_inputs()
    loss, grads = _loss_and_grads(model, inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.enable_gradient_checkpointing()
    ckpt_loss, ckpt_grads = _loss_and_grads(model, inputs)
    torch.testing.assert_close(ckpt_loss, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    for key, value in model.state_dict().items():  # no running statistics moved by the recomputation
        assert torch.equal(value, state[key]), key


def test_layerwise_casting_stores_bf16_and_computes_fp32():
    model = make_model("lmlp")
    x, ctx, t = make_inputs()
    with torch.no_grad():
        ref = model(x, ctx, t).sample
        model.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32)
        out = model(x, ctx, t).sample
    imlp = model.stack.mid_block.joint_mlp
    assert imlp.dw_conv.weight.dtype == torch.bfloat16 and imlp.fc1.weight.dtype == torch.bfloat16
    assert imlp.norm.weight.dtype == torch.float32  # "norm" is skipped
    assert out.dtype == torch.float32 and (out - ref).norm() / ref.norm() < 0.05
