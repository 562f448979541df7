"""The papers' tables: Table 1's rows and baselines (A2 MLP-Mixer, A3 gMLP) and the cost counts of Tables 1, 3, 4."""

import re

import plain_torch as pt
import pytest
import torch
import torch.nn.functional as F
from plain_torch import EPS, TINY, gelu, layer_norm
from test_reference_conversion import linear, norm
from torch.utils.flop_counter import FlopCounterMode

from diffusers_lmlp import FAMILIES, LMLPTransformer2DModel, MoEMLPModel
from diffusers_lmlp.complexity import complexity, lmlp_block_macs
from diffusers_lmlp.models import from_named_config, named_configs
from diffusers_lmlp.models.mixers.channel_mlp import CHANNEL_MLPS
from diffusers_lmlp.models.mixers.gmlp import GMLPBlock, SpatialGatingUnit
from diffusers_lmlp.models.mixers.lmlp import LMLPBlock
from diffusers_lmlp.models.mixers.mlp_mixer import MLPMixerBlock


def test_named_configs_name_their_family_and_take_overrides_and_the_long_skip_placements():
    assert LMLPTransformer2DModel.named_configs["F2-deep"] == {}  # the defaults: the reference model
    with torch.device("meta"):
        f2 = LMLPTransformer2DModel.from_named_config("F2")
        moe = from_named_config("4E2H", num_layers=0)
    assert (f2.config.num_layers, f2.config.mlp_ratio, f2.config.long_skip) == (12, 5.2, "second_stage")
    assert f2.stack.mid_block.joint_mlp.fc1.out_features == int(512 * 5.2)  # Table 1 footnote: MLP scale 5.2
    assert type(moe) is MoEMLPModel and moe.config.num_layers == 0
    assert (moe.config.num_experts, moe.config.num_heads) == (4, 2)
    assert named_configs()["F2"][0].name == "lmlp" and named_configs()["2E1H"][0].name == "moe_mlp"
    with pytest.raises(ValueError, match=r"Unknown named configuration 'F3'; choose one of \["):
        from_named_config("F3")
    with pytest.raises(ValueError, match=r"Unknown MoEMLPModel configuration 'F2'; choose one of \['2E1H'"):
        MoEMLPModel.from_named_config("F2")
    assert complexity({}, family="lmlp").params == 47_139_122  # a partial config is counted with the defaults
    with pytest.raises(ValueError, match="is not a backbone of a registered block family"):
        complexity({"hidden_size": 32})
    # the L-MLP's long-skip placements differ, and None builds a plain stack
    inputs = (torch.randn(2, 4, 8, 8), torch.randn(2, 5, 16), torch.tensor([3, 500]))
    outputs = {}
    for placement in ("first_stage", "second_stage", None):
        torch.manual_seed(0)
        model = LMLPTransformer2DModel(**TINY, long_skip=placement).eval()
        seen = []
        model.stack.out_blocks[0].register_forward_hook(lambda m, args, out: seen.append(args[1]))
        outputs[placement] = model(*inputs).sample
        assert (seen[0] is None) == (placement is None)
    assert not torch.allclose(outputs["first_stage"], outputs["second_stage"])
    assert not torch.allclose(outputs[None], outputs["second_stage"])


def reference_block(p, x, skip, lateral_mlp, activation, merging, merge_proj, second_stage, skip_stage):
    """One Table 1 block re-stated over its state dict (independent of `LMLPBlock`)."""

    def mlp(p, h, prefix):
        return linear(p, F.gelu(linear(p, h, f"{prefix}.fc1")), f"{prefix}.fc2")

    branch = mlp if lateral_mlp else linear
    x = x + skip if skip is not None and skip_stage == "second_stage" else x
    lateral = x + skip if skip is not None and skip_stage == "first_stage" else x
    left = branch(p, norm(p, lateral.transpose(1, 2), "token_norm"), "left").transpose(1, 2)
    right = branch(p, norm(p, lateral, "channel_norm"), "right")
    x = norm(p, x, "channel_norm")
    left = F.gelu(left) if activation in ("left", "both") else left
    right = F.gelu(right) if activation == "both" else right
    z = {"add": left + right, "prod": left * right, "glu": left * torch.sigmoid(right)}[merging]
    x = x + (linear(p, z, "merge") if merge_proj else z)
    return x + mlp(p, norm(p, x, "channel_norm"), "joint_mlp") if second_stage else x


# name -> the block its row describes: lateral MLP, activation, merging, merge projection, second stage
ROWS = {
    "A1": (True, "none", "add", True, False),
    "B1": (True, "none", "prod", True, False),
    "B2": (True, "none", "glu", True, False),
    "B3": (True, "none", "add", False, False),
    "C1": (True, "none", "add", True, True),
    "D1": (False, "none", "prod", True, True),
    "D2": (False, "none", "add", True, True),
    "E1": (False, "left", "prod", True, True),
    "E2": (False, "both", "add", True, True),
    "F1": (False, "none", "add", True, True),
    "F2": (False, "none", "add", True, True),
}


@pytest.mark.parametrize("name", ROWS)
def test_each_rows_block_computes_what_the_row_describes(name):
    config = LMLPTransformer2DModel.named_configs[name]  # a small block (D = 16, L = 12) with the row's options
    block = LMLPBlock(
        16, 12, config.get("mlp_ratio", 4.0) and 2.0, 1e-5, config.get("lateral_mlp_ratio") and 1.5,
        config.get("lateral_activation", "none"), config.get("merging", "add"), config.get("merge_proj", True),
        config.get("long_skip") or "second_stage",
    )  # fmt: skip
    pt.randomize_(block, seed=0)
    x, skip = torch.randn(2, 2, 12, 16, generator=torch.Generator().manual_seed(1))
    for s in (None, skip):
        expected = reference_block(block.state_dict(), x, s, *ROWS[name], block.skip_stage)
        torch.testing.assert_close(block(x, s), expected, rtol=1e-5, atol=1e-5)
    if ROWS[name][3]:  # with a merge projection, Z keeps the left's transposed layout: it rounds as the reference
        seen = []
        block.merge.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
        block(x)
        assert seen == [False]


MIXER, GMLP = FAMILIES["mlp_mixer"].model_class, FAMILIES["gmlp"].model_class


def mixer_reference(sd, x, skip):
    """MLP-Mixer eq. 1 over the block's state dict: U = X + W2 σ(W1 LN(X)) over tokens, Y = U + W4 σ(W3 LN(U))."""
    x = x if skip is None else x + skip
    n = layer_norm(x, sd["norm1.weight"], sd["norm1.bias"])
    # token mixing: every channel d is an L-vector n[:, d] mixed by the (D_S, L) and (L, D_S) matrices
    h = gelu(torch.einsum("sl,bld->bsd", sd["token_mlp.fc1.weight"], n) + sd["token_mlp.fc1.bias"][:, None])
    u = x + torch.einsum("ls,bsd->bld", sd["token_mlp.fc2.weight"], h) + sd["token_mlp.fc2.bias"][:, None]
    n = layer_norm(u, sd["norm2.weight"], sd["norm2.bias"])
    h = gelu(torch.einsum("cd,bld->blc", sd["channel_mlp.fc1.weight"], n) + sd["channel_mlp.fc1.bias"])
    return u + torch.einsum("dc,blc->bld", sd["channel_mlp.fc2.weight"], h) + sd["channel_mlp.fc2.bias"]


def gmlp_reference(sd, x, skip):
    """gMLP: Z = σ(XU), Z̃ = Z_1 ⊙ (W·LN(Z_2) + b) over tokens, Y = Z̃V + X."""
    x = x if skip is None else x + skip
    n = layer_norm(x, sd["norm.weight"], sd["norm.bias"])
    z = gelu(n @ sd["channel_proj1.weight"].T + sd["channel_proj1.bias"])
    z1, z2 = z.chunk(2, dim=-1)
    z2 = layer_norm(z2, sd["sgu.norm.weight"], sd["sgu.norm.bias"])
    gate = torch.einsum("ij,bjd->bid", sd["sgu.spatial_proj.weight"], z2) + sd["sgu.spatial_proj.bias"][:, None]
    return x + (z1 * gate) @ sd["channel_proj2.weight"].T + sd["channel_proj2.bias"]


def mixer_block_macs(config, seq_len):  # the paper's 2·L·D·(D_S + D_C)
    d = config["hidden_size"]
    return 2 * seq_len * d * (int(seq_len * config["token_mlp_ratio"]) + int(d * config["mlp_ratio"]))


def gmlp_block_macs(config, seq_len):  # the paper's 1.5·L·D·d_ffn + d_ffn/2·L²
    d, d_ffn = config["hidden_size"], int(config["hidden_size"] * config["mlp_ratio"])
    return seq_len * d * d_ffn + seq_len * d_ffn // 2 * d + d_ffn // 2 * seq_len**2


# named config -> (model class, a block, its re-statement, its closed-form MACs); its size: NAMED
BASELINES = {
    "A2": (MIXER, MLPMixerBlock(24, 11, 1.5, 3.0, EPS), mixer_reference, mixer_block_macs),
    "A3": (GMLP, GMLPBlock(24, 11, 2.5, EPS), gmlp_reference, gmlp_block_macs),
}


@pytest.mark.parametrize("with_skip", [False, True])
@pytest.mark.parametrize("name", BASELINES)
def test_block_matches_plain_torch_restatement(name, with_skip):
    _, block, reference, _ = BASELINES[name]
    pt.check_block_matches_reference(block, reference, with_skip)


@pytest.mark.parametrize("name", BASELINES)
def test_named_config_on_a1s_skeleton_and_tiny_models_are_counted_exactly_and_the_long_skip_switch(name, tmp_path):
    model_class, _, _, block_macs = BASELINES[name]
    with torch.device("meta"):
        model = model_class.from_named_config(name)
    pt.check_matches_a1(model)
    pt.check_counted_exactly(model, block_macs(model.config, pt.A1_SEQ_LEN))
    block = model.stack.mid_block
    if name == "A2":
        assert block.token_mlp.fc1.out_features == 668 and block.channel_mlp.fc1.out_features == 1280
    else:
        assert block.channel_proj1.out_features == 2140  # d_ffn
    for long_skips in (True, False):
        model = model_class(**TINY, long_skips=long_skips)
        pt.check_counted_exactly(model, block_macs(model.config, pt.TINY_SEQ_LEN))
    pt.check_long_skips_off_builds_a_plain_stack(model_class)
    pt.check_long_skips_on_feed_out_blocks_the_in_blocks_outputs(model_class)
    pt.check_long_skips_setting_survives_save_and_load(model_class, tmp_path)


@pytest.mark.parametrize("channel_mlp", sorted(CHANNEL_MLPS))
def test_mixer_takes_any_channel_mlp(channel_mlp):
    model = MIXER(**TINY, channel_mlp=channel_mlp)
    assert all(isinstance(block.channel_mlp, CHANNEL_MLPS[channel_mlp]) for block in model.stack.out_blocks)
    assert complexity(model).params == sum(p.numel() for p in model.parameters())


def test_spatial_gate_starts_near_identity_and_an_odd_width_is_refused_with_a_ratio_that_works():
    """W ~ U(±0.01), b = 1 in every block (the generic Linear init would give b = 0: a gate that closes the unit)."""
    model = GMLP(**TINY)
    units = [m for m in model.modules() if isinstance(m, SpatialGatingUnit)]
    assert len(units) == 3 and all(torch.equal(unit.spatial_proj.bias, torch.ones(22)) for unit in units)
    weights = torch.stack([unit.spatial_proj.weight for unit in units])
    assert weights.abs().max() <= 0.01 and weights.std(dim=(1, 2)).min() > 0.004  # near zero, not zero (0.0058)
    # With U = 1 the unit's output is its gate W·LN(Z_2) + b, which starts at ≈ 1: Z_1 passes through.
    z = torch.cat([torch.ones(4, 22, 96), 3 * torch.randn(4, 22, 96, generator=torch.Generator().manual_seed(5))], -1)
    gate = units[0](z)  # (B, L, d_ffn / 2)
    assert gate.shape == (4, 22, 96) and (gate - 1).abs().mean() < 0.05 and (gate - 1).abs().max() < 0.25
    with pytest.raises(ValueError, match=r"d_ffn = int\(32 × 1.03125\) = 33, which is odd") as excinfo:
        GMLP(**TINY, mlp_ratio=1.03125)
    suggested = float(re.search(r"e\.g\. mlp_ratio=([0-9.]+)", str(excinfo.value)).group(1))
    assert GMLP(**TINY, mlp_ratio=suggested).stack.mid_block.channel_proj1.out_features == 34


# The papers' models (COCO, L = 334): exact parameters, Table 1's size of the row's group (or None), and for the
# models compared on cost their per-sample forward MACs and blocks.
NAMED = {
    **dict.fromkeys(["A1", "B1", "B2"], (23_484_738, 23.5e6, None)),
    "A2": (23_486_038, 23.5e6, None),  # MLP-Mixer
    "A3": (23_478_758, 23.5e6, None),  # gMLP
    "B3": (23_464_237, 23.5e6, None),
    "A1-45M": (44_386_684, 45e6, None),
    "C1": (44_385_046, 45e6, None),
    **dict.fromkeys(["D1", "D2", "E1", "E2", "F1", "F2"], (44_366_248, 45e6, None)),
    "F2-deep": (47_139_122, 47e6, (15_890_778_112, 17)),
    "2E1H": (49_052_642, None, (15_894_593_728, 17)),
    "4E1H": (52_868_292, None, (15_898_409_344, 17)),
    "4E2H": (60_499_592, None, (15_906_040_576, 17)),
    "ParaMixer-S": (44_955_812, None, (13_431_341_056, 17)),
    "SymMixer-S": (44_955_812, None, (26_827_423_744, 17)),
    "AsymMixer-S": (44_955_812, None, (20_129_382_400, 17)),
    "U-ViT-S/2": (44_692_644, None, (16_229_715_968, 13)),
    "U-ViT-S/2-deep": (58_345_636, None, (21_239_566_336, 17)),
}
# TINY: L = 1 + 5 + (8 / 2)² = 22, 3 blocks. ParaMixer's default widths: token 16, channel 128.
TINY_CASES = [  # family, its options, parameters and MACs
    ("lmlp", {}, 35_766, 753_536),
    ("lmlp", {"conv_out": False, "out_channels": 8, "mlp_ratio": 2.5}, 26_786, 552_832),
    ("moe_mlp", {"num_experts": 3, "num_heads": 2}, 43_770, 763_040),
    ("moe_mlp", {"num_experts": 3, "num_heads": 2, "conv_out": False}, 43_622, 753_824),
    ("paramixer", {}, 33_444, 639_488),
    ("paramixer", {"num_iterations": 3}, 33_444, 1_856_000),
    ("symmixer", {}, 20_100, 639_488),
    ("symmixer", {"conv_out": False, "mlp_ratio": 2.5, "token_mlp_ratio": 0.75}, 15_872, 461_312),
    ("asymmixer", {}, 33_444, 943_616),
    ("asymmixer", {"num_iterations": 2}, 33_444, 1_856_000),
]


@pytest.mark.parametrize("name", sorted(named_configs()))
def test_named_models_are_counted_exactly(name):
    with torch.device("meta"):
        model = from_named_config(name)
    counted = complexity(model)
    assert counted.params == model.num_parameters()
    if name not in NAMED:  # the worlds' models
        return
    params, table, cost = NAMED[name]
    assert counted.params == params and (table is None or abs(params - table) / table < 0.03)
    assert not cost or (counted.macs, counted.num_blocks, counted.seq_len) == (*cost, 334)
    # L-MLP Table 4 reports 15.95 GMACs for UL-MLP (F2-deep); the Mixers are sized like Table 1's F2
    assert name not in ("F2-deep", "2E1H", "4E1H", "4E2H") or 15.8e9 <= counted.macs <= 16.0e9
    assert not name.endswith("Mixer-S") or abs(counted.params / NAMED["F2"][0] - 1) < 0.03
    if name == "F2-deep":  # L-MLP Table 3: 0.933 G per block
        assert counted.block_macs == lmlp_block_macs(334, 512, 4) == 10 * 334 * 512**2 + 334**2 * 512 == 932_677_632


@pytest.mark.parametrize("family, overrides, expected_params, expected_macs", TINY_CASES)
def test_tiny_models_are_counted_from_the_model_or_its_config(family, overrides, expected_params, expected_macs):
    model = FAMILIES[family].model_class(**TINY, **overrides)
    counted = complexity(model)
    assert counted == complexity(model.config, family=family)
    assert counted == complexity({**model.config, "_class_name": type(model).__name__})
    assert counted.params == expected_params == model.num_parameters()
    assert counted.macs == expected_macs
    # A real forward on CPU tensors with batch 3 counts the same per sample as the meta count.
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(3, 4, 8, 8), torch.zeros(3, 5, 16), torch.zeros(3, dtype=torch.long))
    assert counter.get_total_flops() == 2 * 3 * expected_macs
