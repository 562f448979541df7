"""L-MLP Table 1's baselines MLP-Mixer (A2) and gMLP (A3): blocks vs their papers, sizes, cost, skips, config checks."""

import re

import plain_torch as pt
import pytest
import torch
from plain_torch import EPS, TINY, gelu, layer_norm

from diffusers_lmlp import GMLPTransformer2DModel, MLPMixerTransformer2DModel
from diffusers_lmlp.complexity import complexity
from diffusers_lmlp.models.mixers.channel_mlp import CHANNEL_MLPS
from diffusers_lmlp.models.mixers.gmlp import GMLPBlock, SpatialGatingUnit
from diffusers_lmlp.models.mixers.mlp_mixer import MLPMixerBlock


def mixer_reference(sd, x, skip):
    """MLP-Mixer eq. 1 over the block's state dict: U = X + W2 σ(W1 LN(X)) over tokens, Y = U + W4 σ(W3 LN(U))."""
    if skip is not None:
        x = x + skip
    n = layer_norm(x, sd["norm1.weight"], sd["norm1.bias"])
    # token mixing: every channel d is an L-vector n[:, d] mixed by the (D_S, L) and (L, D_S) matrices
    h = gelu(torch.einsum("sl,bld->bsd", sd["token_mlp.fc1.weight"], n) + sd["token_mlp.fc1.bias"][:, None])
    u = x + torch.einsum("ls,bsd->bld", sd["token_mlp.fc2.weight"], h) + sd["token_mlp.fc2.bias"][:, None]
    n = layer_norm(u, sd["norm2.weight"], sd["norm2.bias"])
    h = gelu(torch.einsum("cd,bld->blc", sd["channel_mlp.fc1.weight"], n) + sd["channel_mlp.fc1.bias"])
    return u + torch.einsum("dc,blc->bld", sd["channel_mlp.fc2.weight"], h) + sd["channel_mlp.fc2.bias"]


def gmlp_reference(sd, x, skip):
    """gMLP: Z = σ(XU), Z̃ = Z_1 ⊙ (W·LN(Z_2) + b) over tokens, Y = Z̃V + X."""
    if skip is not None:
        x = x + skip
    n = layer_norm(x, sd["norm.weight"], sd["norm.bias"])
    z = gelu(n @ sd["channel_proj1.weight"].T + sd["channel_proj1.bias"])
    half = z.shape[-1] // 2
    z1, z2 = z[..., :half], z[..., half:]
    z2 = layer_norm(z2, sd["sgu.norm.weight"], sd["sgu.norm.bias"])
    gate = torch.einsum("ij,bjd->bid", sd["sgu.spatial_proj.weight"], z2) + sd["sgu.spatial_proj.bias"][:, None]
    return x + (z1 * gate) @ sd["channel_proj2.weight"].T + sd["channel_proj2.bias"]


def mixer_block_macs(config, seq_len):
    """The Mixer block's multiply-adds from its paper: 2·L·D·(D_S + D_C)."""
    d = config["hidden_size"]
    return 2 * seq_len * d * (int(seq_len * config["token_mlp_ratio"]) + int(d * config["mlp_ratio"]))


def gmlp_block_macs(config, seq_len):
    """The gMLP block's multiply-adds from its paper: 1.5·L·D·d_ffn + d_ffn/2·L²."""
    d = config["hidden_size"]
    d_ffn = int(d * config["mlp_ratio"])
    return seq_len * d * d_ffn + seq_len * d_ffn // 2 * d + d_ffn // 2 * seq_len**2


# name -> (model class, a block, its re-statement, its closed-form MACs, named config, its parameters)
BASELINES = {
    "mlp_mixer": (MLPMixerTransformer2DModel, MLPMixerBlock(24, 11, 1.5, 3.0, EPS), mixer_reference)
    + (mixer_block_macs, "A2", 23_486_038),
    "gmlp": (GMLPTransformer2DModel, GMLPBlock(24, 11, 2.5, EPS), gmlp_reference, gmlp_block_macs, "A3", 23_478_758),
}


@pytest.fixture(params=list(BASELINES))
def baseline(request):
    return BASELINES[request.param]


@pytest.mark.parametrize("with_skip", [False, True])
def test_block_matches_plain_torch_restatement(baseline, with_skip):
    _, block, reference, *_ = baseline
    pt.check_block_matches_reference(block, reference, with_skip)


def test_named_config_matches_a1_size_and_is_counted_exactly(baseline):
    model_class, _, _, block_macs, name, params = baseline
    with torch.device("meta"):
        model = model_class.from_named_config(name)
    assert sum(p.numel() for p in model.parameters()) == params
    pt.check_matches_a1(model)
    pt.check_counted_exactly(model, block_macs(model.config, pt.A1_SEQ_LEN))
    block = model.stack.mid_block
    if name == "A2":
        assert block.token_mlp.fc1.out_features == 668 and block.channel_mlp.fc1.out_features == 1280
    else:
        assert block.channel_proj1.out_features == 2140  # d_ffn


@pytest.mark.parametrize("long_skips", [True, False])
def test_tiny_model_is_counted_exactly(baseline, long_skips):
    model_class, _, _, block_macs, *_ = baseline
    torch.manual_seed(0)
    model = model_class(**TINY, long_skips=long_skips)
    pt.check_counted_exactly(model, block_macs(model.config, pt.TINY_SEQ_LEN))


def test_the_long_skip_switch(baseline, tmp_path):  # gradients: test_models.py
    model_class = baseline[0]
    pt.check_long_skips_off_builds_a_plain_stack(model_class)
    pt.check_long_skips_on_feed_out_blocks_the_in_blocks_outputs(model_class)
    pt.check_long_skips_setting_survives_save_and_load(model_class, tmp_path)


@pytest.mark.parametrize("channel_mlp", sorted(CHANNEL_MLPS))
def test_mixer_takes_any_channel_mlp(channel_mlp):
    torch.manual_seed(0)
    model = MLPMixerTransformer2DModel(**TINY, channel_mlp=channel_mlp)
    assert all(isinstance(block.channel_mlp, CHANNEL_MLPS[channel_mlp]) for block in model.stack.out_blocks)
    assert complexity(model).params == sum(p.numel() for p in model.parameters())


def test_spatial_gate_starts_near_identity():
    """W ~ U(±0.01), b = 1 in every block (the generic Linear init would give b = 0: a gate that closes the unit)."""
    torch.manual_seed(0)
    model = GMLPTransformer2DModel(**TINY)
    units = [m for m in model.modules() if isinstance(m, SpatialGatingUnit)]
    assert len(units) == 3  # 1 + 1 + 1 blocks
    for unit in units:
        weight = unit.spatial_proj.weight
        assert torch.equal(unit.spatial_proj.bias, torch.ones(22))
        assert weight.abs().max() <= 0.01 and weight.std() > 0.004  # near zero, but not zero (U(±0.01): 0.0058)
    # With U = 1 the unit's output is its gate W·LN(Z_2) + b, which starts at ≈ 1: Z_1 passes through.
    gen = torch.Generator().manual_seed(5)
    z = torch.cat([torch.ones(4, 22, 96), 3 * torch.randn(4, 22, 96, generator=gen)], dim=-1)  # (B, L, d_ffn)
    with torch.no_grad():
        gate = units[0](z)
    assert gate.shape == (4, 22, 96)
    assert (gate - 1).abs().mean() < 0.05 and (gate - 1).abs().max() < 0.25


def test_an_odd_gmlp_width_is_refused_with_a_ratio_that_works():
    with pytest.raises(ValueError, match=r"d_ffn = int\(32 × 1.03125\) = 33, which is odd") as excinfo:
        GMLPTransformer2DModel(**TINY, mlp_ratio=1.03125)
    suggested = float(re.search(r"e\.g\. mlp_ratio=([0-9.]+)", str(excinfo.value)).group(1))
    model = GMLPTransformer2DModel(**TINY, mlp_ratio=suggested)
    assert model.stack.mid_block.channel_proj1.out_features == 34
