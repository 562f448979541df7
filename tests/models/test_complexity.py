"""Complexity accounting against the papers' tables and against the models themselves."""

import pytest
import torch
from plain_torch import TINY
from test_table1 import TABLE_1_PARAMS
from torch.utils.flop_counter import FlopCounterMode

from diffusers_lmlp import FAMILIES, LMLPTransformer2DModel, MoEMLPModel, from_named_config
from diffusers_lmlp.complexity import complexity, lmlp_block_macs, transformer_block_macs
from diffusers_lmlp.models import named_configs


# The papers' models on the COCO skeleton (L = 334): exact parameters, per-sample forward MACs and blocks.
NAMED = {
    "F2-deep": (47_139_122, 15_890_778_112, 17),
    "2E1H": (49_052_642, 15_894_593_728, 17),
    "4E1H": (52_868_292, 15_898_409_344, 17),
    "4E2H": (60_499_592, 15_906_040_576, 17),
    "ParaMixer-S": (44_955_812, 13_431_341_056, 17),
    "SymMixer-S": (44_955_812, 26_827_423_744, 17),
    "AsymMixer-S": (44_955_812, 20_129_382_400, 17),
    "U-ViT-S/2": (44_692_644, 16_229_715_968, 13),
    "U-ViT-S/2-deep": (58_345_636, 21_239_566_336, 17),
}
# TINY: L = 1 + 5 + (8 / 2)² = 22, 3 blocks. ParaMixer's default widths: token 16, channel 128.
TINY_CASES = {  # family, its options, parameters and MACs
    "lmlp": ("lmlp", {}, 35_766, 753_536),
    "lmlp_no_conv_out": ("lmlp", {"conv_out": False, "out_channels": 8, "mlp_ratio": 2.5}, 26_786, 552_832),
    "moe_3e2h": ("moe_mlp", {"num_experts": 3, "num_heads": 2}, 43_770, 763_040),
    "moe_3e2h_no_conv_out": ("moe_mlp", {"num_experts": 3, "num_heads": 2, "conv_out": False}, 43_622, 753_824),
    "paramixer": ("paramixer", {}, 33_444, 639_488),
    "paramixer_3_iterations": ("paramixer", {"num_iterations": 3}, 33_444, 1_856_000),
    "symmixer": ("symmixer", {}, 20_100, 639_488),
    "symmixer_other_widths": (
        "symmixer",
        {"conv_out": False, "mlp_ratio": 2.5, "token_mlp_ratio": 0.75},
        15_872,
        461_312,
    ),
    "asymmixer": ("asymmixer", {}, 33_444, 943_616),
    "asymmixer_2_iterations": ("asymmixer", {"num_iterations": 2}, 33_444, 1_856_000),
}


def test_block_formulas_match_lmlp_table3():
    assert lmlp_block_macs(334, 512, 4) == 10 * 334 * 512**2 + 334**2 * 512 == 932_677_632  # 0.933 G
    assert transformer_block_macs(334, 512, 4) == 12 * 334 * 512**2 + 2 * 334**2 * 512 == 1_164_906_496  # 1.165 G


@pytest.mark.parametrize("name", sorted(named_configs()))
def test_named_models_are_counted_exactly(name):
    with torch.device("meta"):
        model = from_named_config(name)
    counted = complexity(model)
    assert counted.params == model.num_parameters()
    if name in TABLE_1_PARAMS:  # the size Table 1 gives the row's group
        exact, table = TABLE_1_PARAMS[name]
        assert counted.params == exact and abs(exact - table) / table < 0.03
    if name in NAMED:
        expected_params, expected_macs, num_blocks = NAMED[name]
        assert (counted.params, counted.macs) == (expected_params, expected_macs)
        assert (counted.seq_len, counted.num_blocks) == (334, num_blocks)
    if name in ("F2-deep", "2E1H", "4E1H", "4E2H"):
        assert 15.8e9 <= counted.macs <= 16.0e9  # L-MLP Table 4 reports 15.95 GMACs for UL-MLP (F2-deep)
    if name.endswith("Mixer-S"):
        assert abs(counted.params / TABLE_1_PARAMS["F2"][0] - 1) < 0.03  # sized like Table 1's F2
    if name == "F2-deep":
        assert counted.block_macs == lmlp_block_macs(334, 512, 4)


@pytest.mark.parametrize("case", TINY_CASES)
def test_tiny_models_are_counted_from_the_model_or_its_config(case):
    family, overrides, expected_params, expected_macs = TINY_CASES[case]
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


def test_moe_with_one_expert_one_head_costs_lmlp_plus_gate_and_mix():
    with torch.device("meta"):
        moe, lmlp = complexity(MoEMLPModel(num_experts=1, num_heads=1)), complexity(LMLPTransformer2DModel())
    extra = moe.block_macs - lmlp.block_macs
    assert extra == 334**2 + 2 * 334 == 112_224  # g·W (L²), g·b (L) and the L→1 gate (L)
    assert extra / lmlp_block_macs(334, 512, 4) < 1.3e-4
    assert moe.macs - lmlp.macs == 17 * extra
    assert moe.params - lmlp.params == 17 * (334 + 1)  # only the gate's weight and bias are new


def test_a_config_is_counted_by_its_family_and_parallel_mixers_by_their_mlp_kind():
    # Per iteration each MLP matmul costs L·D·t (token) or L·D·c (channel); vanilla 2, symmetric 2, asymmetric 3.
    config = {"hidden_size": 512, "token_mlp_ratio": 0.5, "mlp_ratio": 4.0, "num_iterations": 2}
    per_matmul = 334 * 512 * (256 + 2048)
    for family, matmuls in (("paramixer", 2), ("symmixer", 2), ("asymmixer", 3)):
        assert complexity(config, family=family).block_macs == 2 * matmuls * per_matmul
    with pytest.raises(ValueError, match="is not a backbone of a registered block family"):
        complexity({"hidden_size": 32})
    assert complexity({}, family="lmlp").params == 47_139_122  # the defaults fill a partial config
