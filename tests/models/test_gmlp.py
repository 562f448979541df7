"""gMLP, L-MLP Table 1's baseline A3: the block against a plain-torch re-statement of its paper, the spatial gate's
init, the named config's size, exact complexity, gradients, the long-skip switch and its config checks."""

import re

import pytest
import torch
from plain_torch import (
    A1_SEQ_LEN,
    EPS,
    TINY,
    TINY_SEQ_LEN,
    check_block_matches_reference,
    check_counted_exactly,
    check_every_parameter_gets_a_gradient,
    check_long_skips_off_builds_a_plain_stack,
    check_long_skips_on_feed_out_blocks_the_in_blocks_outputs,
    check_long_skips_setting_survives_save_and_load,
    check_matches_a1,
    gelu,
    layer_norm,
)

from diffusers_lmlp import GMLPTransformer2DModel
from diffusers_lmlp.models.mixers.gmlp import GMLPBlock, SpatialGatingUnit


def gmlp_reference(sd, x, skip):
    """gMLP as paper 002 writes it: Z = σ(XU), Z̃ = Z_1 ⊙ (W·LN(Z_2) + b) over tokens, Y = Z̃V + X."""
    if skip is not None:
        x = x + skip
    n = layer_norm(x, sd["norm.weight"], sd["norm.bias"])
    z = gelu(n @ sd["channel_proj1.weight"].T + sd["channel_proj1.bias"])
    half = z.shape[-1] // 2
    z1, z2 = z[..., :half], z[..., half:]
    z2 = layer_norm(z2, sd["sgu.norm.weight"], sd["sgu.norm.bias"])
    gate = torch.einsum("ij,bjd->bid", sd["sgu.spatial_proj.weight"], z2) + sd["sgu.spatial_proj.bias"][:, None]
    return x + (z1 * gate) @ sd["channel_proj2.weight"].T + sd["channel_proj2.bias"]


def closed_form_block_macs(config, seq_len):
    """The block's multiply-adds written from its paper: 1.5·L·D·d_ffn + d_ffn/2·L²."""
    d = config["hidden_size"]
    d_ffn = int(d * config["mlp_ratio"])
    return seq_len * d * d_ffn + seq_len * d_ffn // 2 * d + d_ffn // 2 * seq_len**2


@pytest.mark.parametrize("with_skip", [False, True])
def test_block_matches_plain_torch_restatement(with_skip):
    block = GMLPBlock(24, 11, mlp_ratio=2.5, norm_eps=EPS)
    check_block_matches_reference(block, gmlp_reference, with_skip)


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


def test_a3_matches_a1_size():
    with torch.device("meta"):
        a3 = GMLPTransformer2DModel.from_named_config("A3")
    assert sum(p.numel() for p in a3.parameters()) == 23_478_758
    check_matches_a1(a3)
    assert a3.stack.mid_block.channel_proj1.out_features == 2140  # d_ffn


@pytest.mark.parametrize("long_skips", [True, False])
def test_tiny_model_is_counted_exactly(long_skips):
    torch.manual_seed(0)
    model = GMLPTransformer2DModel(**TINY, long_skips=long_skips)
    check_counted_exactly(model, closed_form_block_macs(model.config, TINY_SEQ_LEN))


@pytest.mark.slow
def test_a3_is_counted_exactly():
    with torch.device("meta"):
        model = GMLPTransformer2DModel.from_named_config("A3")
    check_counted_exactly(model, closed_form_block_macs(model.config, A1_SEQ_LEN))


def test_every_parameter_gets_a_gradient():
    check_every_parameter_gets_a_gradient(GMLPTransformer2DModel)


def test_long_skips_off_builds_a_plain_stack():
    check_long_skips_off_builds_a_plain_stack(GMLPTransformer2DModel)


def test_long_skips_on_feed_out_blocks_the_in_blocks_outputs():
    check_long_skips_on_feed_out_blocks_the_in_blocks_outputs(GMLPTransformer2DModel)


def test_long_skips_setting_survives_save_and_load(tmp_path):
    check_long_skips_setting_survives_save_and_load(GMLPTransformer2DModel, tmp_path)


def test_odd_width_is_refused_with_a_ratio_that_works():
    with pytest.raises(ValueError, match=r"d_ffn = int\(32 × 1.03125\) = 33, which is odd") as excinfo:
        GMLPTransformer2DModel(**TINY, mlp_ratio=1.03125)
    suggested = float(re.search(r"e\.g\. mlp_ratio=([0-9.]+)", str(excinfo.value)).group(1))
    model = GMLPTransformer2DModel(**TINY, mlp_ratio=suggested)
    assert model.stack.mid_block.channel_proj1.out_features == 34


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"long_skips": None}, "long_skips must be True or False"),
        ({"mlp_ratio": 0.0}, "mlp_ratio must be a positive finite number"),
    ],
)
def test_bad_config_raises_a_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        GMLPTransformer2DModel(**TINY, **overrides)
