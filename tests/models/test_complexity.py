"""Complexity accounting against the papers' tables and against the models themselves."""

import pytest
import torch
from plain_torch import TINY
from torch.utils.flop_counter import FlopCounterMode

from diffusers_lmlp import (
    FAMILIES,
    AsymMixerTransformer2DModel,
    LMLPTransformer2DModel,
    MoEMLPModel,
    ParaMixerTransformer2DModel,
    SymMixerTransformer2DModel,
)
from diffusers_lmlp.complexity import complexity, lmlp_block_macs, transformer_block_macs
from diffusers_lmlp.models import named_configs


# F2-deep and the MoE-MLP paper's models: exact parameter counts and per-sample forward MACs (L = 334, 17 blocks).
NAMED = {
    "F2-deep": (LMLPTransformer2DModel, 47_139_122, 15_890_778_112),
    "2E1H": (MoEMLPModel, 49_052_642, 15_894_593_728),
    "4E1H": (MoEMLPModel, 52_868_292, 15_898_409_344),
    "4E2H": (MoEMLPModel, 60_499_592, 15_906_040_576),
}
# TINY: L = 1 + 5 + (8 / 2)² = 22, 3 blocks.
TINY_CASES = {
    "lmlp": (LMLPTransformer2DModel, {}, 35_766, 753_536),
    "lmlp_no_conv_out": (
        LMLPTransformer2DModel,
        {"conv_out": False, "out_channels": 8, "mlp_ratio": 2.5},
        26_786,
        552_832,
    ),
    "moe_3e2h": (MoEMLPModel, {"num_experts": 3, "num_heads": 2}, 43_770, 763_040),
    "moe_3e2h_no_conv_out": (MoEMLPModel, {"num_experts": 3, "num_heads": 2, "conv_out": False}, 43_622, 753_824),
    # ParaMixer, SymMixer, AsymMixer (default widths: token 16, channel 128)
    "paramixer": (ParaMixerTransformer2DModel, {}, 33_444, 639_488),
    "paramixer_3_iterations": (ParaMixerTransformer2DModel, {"num_iterations": 3}, 33_444, 1_856_000),
    "symmixer": (SymMixerTransformer2DModel, {}, 20_100, 639_488),
    "symmixer_other_widths": (
        SymMixerTransformer2DModel,
        {"conv_out": False, "mlp_ratio": 2.5, "token_mlp_ratio": 0.75},
        15_872,
        461_312,
    ),
    "asymmixer": (AsymMixerTransformer2DModel, {}, 33_444, 943_616),
    "asymmixer_2_iterations": (AsymMixerTransformer2DModel, {"num_iterations": 2}, 33_444, 1_856_000),
}


FAMILIES_BY_CLASS = {family.model_class: name for name, family in FAMILIES.items()}


def build_named(name: str) -> torch.nn.Module:
    model_cls = NAMED[name][0]
    with torch.device("meta"):
        return model_cls.from_named_config(name)


def test_block_formulas_match_lmlp_table3():
    assert lmlp_block_macs(334, 512, 4) == 10 * 334 * 512**2 + 334**2 * 512 == 932_677_632  # 0.933 G
    assert transformer_block_macs(334, 512, 4) == 12 * 334 * 512**2 + 2 * 334**2 * 512 == 1_164_906_496  # 1.165 G


@pytest.mark.parametrize("name", NAMED)
def test_named_models_are_counted_exactly(name):
    model = build_named(name)
    expected_params, expected_macs = NAMED[name][1:]
    counted = complexity(model)
    assert counted.params == expected_params == model.num_parameters()
    assert counted.macs == expected_macs
    assert 15.8e9 <= counted.macs <= 16.0e9  # L-MLP Table 4 reports 15.95 GMACs for UL-MLP (F2-deep)
    assert (counted.seq_len, counted.num_blocks) == (334, 17)
    if name == "F2-deep":
        assert counted.block_macs == lmlp_block_macs(334, 512, 4)


@pytest.mark.parametrize("case", TINY_CASES)
def test_tiny_models_are_counted_from_the_model_or_its_config(case):
    model_cls, overrides, expected_params, expected_macs = TINY_CASES[case]
    model = model_cls(**TINY, **overrides)
    counted = complexity(model)
    assert counted == complexity(model.config, family=FAMILIES_BY_CLASS[model_cls])
    assert counted == complexity({**model.config, "_class_name": model_cls.__name__})
    assert counted.params == expected_params == model.num_parameters()
    assert counted.macs == expected_macs
    # A real forward on CPU tensors with batch 3 counts the same per sample as the meta count.
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.zeros(3, 4, 8, 8), torch.zeros(3, 5, 16), torch.zeros(3, dtype=torch.long))
    assert counter.get_total_flops() == 2 * 3 * expected_macs


def test_moe_with_one_expert_one_head_costs_lmlp_plus_gate_and_mix():
    seq_len = 334
    with torch.device("meta"):
        moe = MoEMLPModel(num_experts=1, num_heads=1)
    lmlp = complexity(build_named("F2-deep"))
    moe_complexity = complexity(moe)
    extra = moe_complexity.block_macs - lmlp.block_macs
    assert lmlp.block_macs == lmlp_block_macs(seq_len, 512, 4)
    assert extra == seq_len**2 + 2 * seq_len == 112_224  # g·W (L²), g·b (L) and the L→1 gate (L)
    assert extra / lmlp_block_macs(seq_len, 512, 4) < 1.3e-4
    assert moe_complexity.macs - lmlp.macs == 17 * extra
    assert moe_complexity.params - lmlp.params == 17 * (seq_len + 1)  # only the gate's weight and bias are new


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(named_configs()))
def test_every_named_config_is_counted_exactly(name):
    family, _ = named_configs()[name]
    with torch.device("meta"):
        model = family.model_class.from_named_config(name)
    assert complexity(model).params == model.num_parameters()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_is_counted_exactly_on_a_tiny_model(name):
    family = FAMILIES[name]
    counted = {}
    for pooled in (False, True):
        with torch.device("meta"):
            model = family.model_class(**TINY, **family.tiny_overrides, pooled_text_projection=pooled)
        counted[pooled] = complexity(model)
        assert counted[pooled].params == model.num_parameters()
    # The pooled projection is one 16 → 32 Linear on one state per caption.
    assert counted[True].macs - counted[False].macs == 16 * 32
    assert counted[True].params - counted[False].params == 16 * 32 + 32


def test_a_bare_config_needs_its_family():
    with pytest.raises(ValueError, match="is not a backbone of a registered block family"):
        complexity({"hidden_size": 32})
    assert complexity({}, family="lmlp").params == 47_139_122  # the defaults fill a partial config
