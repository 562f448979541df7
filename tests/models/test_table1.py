"""L-MLP Table 1 as named configurations: sizes, and what each row's block computes."""

import pytest
import torch
import torch.nn.functional as F
from plain_torch import TINY

from diffusers_lmlp import LMLPTransformer2DModel, MoEMLPModel
from diffusers_lmlp.models import from_named_config, named_configs
from diffusers_lmlp.models.mixers.lmlp import LMLPBlock


# Exact parameter counts at the COCO skeleton, and the size Table 1 gives the row's group (test_complexity.py).
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


def test_named_configs_name_their_family_and_take_overrides():
    assert LMLPTransformer2DModel.named_configs["F2-deep"] == {}  # the defaults: the reference model
    with torch.device("meta"):
        f2 = LMLPTransformer2DModel.from_named_config("F2")
        moe = from_named_config("4E2H", num_layers=0)
    assert (f2.config.num_layers, f2.config.mlp_ratio, f2.config.long_skip) == (12, 5.2, "second_stage")
    assert f2.stack.mid_block.joint_mlp.fc1.out_features == int(512 * 5.2)  # Table 1 footnote: MLP scale 5.2
    assert type(moe) is MoEMLPModel and (moe.config.num_experts, moe.config.num_heads) == (4, 2)
    assert moe.config.num_layers == 0
    named = named_configs()
    assert named["F2"][0].name == "lmlp" and named["2E1H"][0].name == "moe_mlp"
    with pytest.raises(ValueError, match=r"Unknown named configuration 'F3'; choose one of \["):
        from_named_config("F3")
    with pytest.raises(ValueError, match=r"Unknown MoEMLPModel configuration 'F2'; choose one of \['2E1H'"):
        MoEMLPModel.from_named_config("F2")


def reference_block(p, x, skip, *, lateral_mlp, activation, merging, merge_proj, second_stage, skip_stage):
    """One Table 1 block re-stated over its state dict (independent of `LMLPBlock`)."""

    def linear(h, name):
        return F.linear(h, p[f"{name}.weight"], p[f"{name}.bias"])

    def mlp(h, prefix):
        return linear(F.gelu(linear(h, f"{prefix}.fc1")), f"{prefix}.fc2")

    def norm(h, name):
        return F.layer_norm(h, h.shape[-1:], p[f"{name}.weight"], p[f"{name}.bias"])

    branch = mlp if lateral_mlp else linear
    if skip is not None and skip_stage == "second_stage":
        x = x + skip
    lateral = x + skip if skip is not None and skip_stage == "first_stage" else x
    left = branch(norm(lateral.transpose(1, 2), "token_norm"), "left").transpose(1, 2)
    right = branch(norm(lateral, "channel_norm"), "right")
    x = norm(x, "channel_norm")
    left = F.gelu(left) if activation in ("left", "both") else left
    right = F.gelu(right) if activation == "both" else right
    z = {"add": left + right, "prod": left * right, "glu": left * torch.sigmoid(right)}[merging]
    x = x + (linear(z, "merge") if merge_proj else z)
    return x + mlp(norm(x, "channel_norm"), "joint_mlp") if second_stage else x


# name -> the block options its row describes: lateral MLP, activation, merging, merge projection, second stage
ROWS = {
    name: dict(zip(["lateral_mlp", "activation", "merging", "merge_proj", "second_stage"], options))
    for name, options in {
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
    }.items()
}


def row_block(name: str) -> LMLPBlock:
    """A small block (D = 16, L = 12) with the options of Table 1's row `name`."""
    config = LMLPTransformer2DModel.named_configs[name]
    return LMLPBlock(
        16, 12, config.get("mlp_ratio", 4.0) and 2.0, 1e-5, config.get("lateral_mlp_ratio") and 1.5,
        config.get("lateral_activation", "none"), config.get("merging", "add"), config.get("merge_proj", True),
        config.get("long_skip") or "second_stage",
    )  # fmt: skip


@pytest.mark.parametrize("name", ROWS)
def test_each_rows_block_computes_what_the_row_describes(name):
    block = row_block(name)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():  # random everywhere, so no term hides behind an init value
            param.copy_(0.3 * torch.randn(param.shape, generator=gen) + (1.0 if param.ndim == 1 else 0.0))
    x, skip = torch.randn(2, 12, 16, generator=gen), torch.randn(2, 12, 16, generator=gen)
    for s in (None, skip):
        expected = reference_block(block.state_dict(), x, s, skip_stage=block.skip_stage, **ROWS[name])
        torch.testing.assert_close(block(x, s), expected, rtol=1e-5, atol=1e-5)
    if ROWS[name]["merge_proj"]:  # Z keeps the left's transposed layout: the merge GEMM rounds as the reference
        seen = []
        block.merge.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
        block(x)
        assert seen == [False]


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
