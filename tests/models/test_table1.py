"""L-MLP Table 1 as named configurations: sizes, and what each row's block computes."""

import pytest
import torch
import torch.nn.functional as F
from plain_torch import TINY

from diffusers_lmlp import LMLPTransformer2DModel, MoEMLPModel
from diffusers_lmlp.models import from_named_config, named_configs
from diffusers_lmlp.models.mixers.lmlp import LMLPBlock


# Exact parameter counts at the COCO skeleton, and the size Table 1 gives the row's group.
TABLE_1_PARAMS = {
    "A1": (23_484_738, 23.5e6),
    "B1": (23_484_738, 23.5e6),
    "B2": (23_484_738, 23.5e6),
    "B3": (23_464_237, 23.5e6),
    "A1-45M": (44_386_684, 45e6),
    "C1": (44_385_046, 45e6),
    "D1": (44_366_248, 45e6),
    "D2": (44_366_248, 45e6),
    "E1": (44_366_248, 45e6),
    "E2": (44_366_248, 45e6),
    "F1": (44_366_248, 45e6),
    "F2": (44_366_248, 45e6),
    "F2-deep": (47_139_122, 47e6),
}


@pytest.mark.parametrize("name", TABLE_1_PARAMS)
def test_table1_rows_have_the_tables_size(name):
    with torch.device("meta"):
        model = from_named_config(name)
    params = sum(p.numel() for p in model.parameters())
    exact, table = TABLE_1_PARAMS[name]
    assert params == exact
    assert abs(params - table) / table < 0.03


def test_named_configs_name_their_family_and_take_overrides():
    assert LMLPTransformer2DModel.named_configs["F2-deep"] == {}  # the defaults: the reference model
    with torch.device("meta"):
        f2 = LMLPTransformer2DModel.from_named_config("F2")
        moe = from_named_config("4E2H", num_layers=0)
    assert (f2.config.num_layers, f2.config.mlp_ratio, f2.config.long_skip) == (12, 5.2, "second_stage")
    assert f2.stack.mid_block.joint_mlp.fc1.out_features == int(512 * 5.2)  # Table 1 footnote: MLP scale 5.2
    assert type(moe) is MoEMLPModel and (moe.config.num_experts, moe.config.num_heads, moe.config.num_layers) == (
        4,
        2,
        0,
    )
    named = named_configs()
    assert named["F2"][0].name == "lmlp" and named["2E1H"][0].name == "moe_mlp"
    with pytest.raises(ValueError, match=r"Unknown named configuration 'F3'; choose one of \["):
        from_named_config("F3")
    with pytest.raises(ValueError, match=r"Unknown MoEMLPModel configuration 'F2'; choose one of \['2E1H'"):
        MoEMLPModel.from_named_config("F2")


def reference_block(p: dict, x, skip, *, lateral_mlp, activation, merging, merge_proj, second_stage, skip_stage):
    """One Table 1 block re-stated over its state dict (independent of `LMLPBlock`)."""
    seq_len, hidden = x.shape[1], x.shape[2]

    def mlp(h, prefix):
        return F.linear(
            F.gelu(F.linear(h, p[f"{prefix}.fc1.weight"], p[f"{prefix}.fc1.bias"])),
            p[f"{prefix}.fc2.weight"],
            p[f"{prefix}.fc2.bias"],
        )

    def branch(h, name):
        return mlp(h, name) if lateral_mlp else F.linear(h, p[f"{name}.weight"], p[f"{name}.bias"])

    def channel_norm(h):
        return F.layer_norm(h, (hidden,), p["channel_norm.weight"], p["channel_norm.bias"])

    if skip is not None and skip_stage == "second_stage":
        x = x + skip
    lateral = x + skip if skip is not None and skip_stage == "first_stage" else x
    left = branch(
        F.layer_norm(lateral.transpose(1, 2), (seq_len,), p["token_norm.weight"], p["token_norm.bias"]), "left"
    )
    left = left.transpose(1, 2)
    x = channel_norm(x)
    right = branch(channel_norm(lateral), "right")
    if activation in ("left", "both"):
        left = F.gelu(left)
    if activation == "both":
        right = F.gelu(right)
    z = {"add": left + right, "prod": left * right, "glu": left * torch.sigmoid(right)}[merging]
    if merge_proj:
        z = F.linear(z, p["merge.weight"], p["merge.bias"])
    x = x + z
    if second_stage:
        x = x + mlp(channel_norm(x), "joint_mlp")
    return x


ROWS = {  # name -> the block options its row describes
    "A1": dict(lateral_mlp=True, activation="none", merging="add", merge_proj=True, second_stage=False),
    "B1": dict(lateral_mlp=True, activation="none", merging="prod", merge_proj=True, second_stage=False),
    "B2": dict(lateral_mlp=True, activation="none", merging="glu", merge_proj=True, second_stage=False),
    "B3": dict(lateral_mlp=True, activation="none", merging="add", merge_proj=False, second_stage=False),
    "C1": dict(lateral_mlp=True, activation="none", merging="add", merge_proj=True, second_stage=True),
    "D1": dict(lateral_mlp=False, activation="none", merging="prod", merge_proj=True, second_stage=True),
    "D2": dict(lateral_mlp=False, activation="none", merging="add", merge_proj=True, second_stage=True),
    "E1": dict(lateral_mlp=False, activation="left", merging="prod", merge_proj=True, second_stage=True),
    "E2": dict(lateral_mlp=False, activation="both", merging="add", merge_proj=True, second_stage=True),
    "F1": dict(lateral_mlp=False, activation="none", merging="add", merge_proj=True, second_stage=True),
    "F2": dict(lateral_mlp=False, activation="none", merging="add", merge_proj=True, second_stage=True),
}


def row_block(name: str) -> LMLPBlock:
    """A small block (D = 16, L = 12) with the options of Table 1's row `name`."""
    config = LMLPTransformer2DModel.named_configs[name]
    return LMLPBlock(
        hidden_size=16,
        seq_len=12,
        mlp_ratio=config.get("mlp_ratio", 4.0) and 2.0,
        norm_eps=1e-5,
        lateral_mlp_ratio=config.get("lateral_mlp_ratio") and 1.5,
        lateral_activation=config.get("lateral_activation", "none"),
        merging=config.get("merging", "add"),
        merge_proj=config.get("merge_proj", True),
        skip_stage=config.get("long_skip") or "second_stage",
    )


@pytest.mark.parametrize("name", ROWS)
def test_each_rows_block_computes_what_the_row_describes(name):
    block = row_block(name)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():  # random everywhere, so no term hides behind an init value
            param.copy_(0.3 * torch.randn(param.shape, generator=gen) + (1.0 if param.ndim == 1 else 0.0))
    x, skip = torch.randn(2, 12, 16, generator=gen), torch.randn(2, 12, 16, generator=gen)
    params = dict(block.state_dict())
    skip_stage = block.skip_stage
    for s in (None, skip):
        expected = reference_block(params, x, s, skip_stage=skip_stage, **ROWS[name])
        torch.testing.assert_close(block(x, s), expected, rtol=1e-5, atol=1e-5)


def test_long_skip_placements_differ_and_none_builds_a_plain_stack():
    inputs = (torch.randn(2, 4, 8, 8), torch.randn(2, 5, 16), torch.tensor([3, 500]))
    outputs = {}
    for placement in ("first_stage", "second_stage", None):
        torch.manual_seed(0)
        model = LMLPTransformer2DModel(**TINY, long_skip=placement).eval()
        seen = []
        model.stack.out_blocks[0].register_forward_hook(lambda m, args, out: seen.append(args[1]))
        with torch.no_grad():
            outputs[placement] = model(*inputs).sample
        assert (seen[0] is None) == (placement is None)
    assert not torch.allclose(outputs["first_stage"], outputs["second_stage"])
    assert not torch.allclose(outputs[None], outputs["second_stage"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(merging="sum"), r"merging='sum' cannot build a LMLPTransformer2DModel: merging must be one of"),
        (
            dict(long_skip="third_stage"),
            r"long_skip='third_stage'.*must be one of \('first_stage', 'second_stage'\) or None",
        ),
        (
            dict(lateral_mlp_ratio=2.0, lateral_activation="left"),
            r"lateral_activation='left' applies to Linear hemispheres",
        ),
        (dict(lateral_activation="right"), r"lateral_activation='right'.*must be one of \('none', 'left', 'both'\)"),
        (dict(mlp_ratio=0), r"mlp_ratio=0 cannot build.*a positive finite number or None"),
    ],
)
def test_bad_table1_options_raise_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        LMLPTransformer2DModel(**TINY, **overrides)


@pytest.mark.parametrize("name", [name for name in ROWS if ROWS[name]["merge_proj"]])
def test_the_merge_linear_reads_z_in_the_reference_layout(name):
    """Z = merging(left, right) keeps the left hemisphere's transposed layout, so the merge GEMM rounds as the reference."""
    block = row_block(name)
    seen = []
    block.merge.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    block(torch.randn(2, 12, 16))
    assert seen == [False]
