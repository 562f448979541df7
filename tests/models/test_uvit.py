"""U-ViT: fidelity to the reference `libs/uvit_t2i.py` (explicit per-head softmax(QKᵀ/√d)·V) and its cost; its pipeline:
tests/pipelines."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from plain_torch import TINY, reference_skeleton_forward
from test_reference_conversion import linear, norm, reference_state_dict
from torch.utils.flop_counter import FlopCounterMode

from diffusers_lmlp import UViTTransformer2DModel, convert_uvit_reference_state_dict
from diffusers_lmlp.complexity import complexity, transformer_block_macs
from diffusers_lmlp.models.families import FAMILIES, family_of
from diffusers_lmlp.models.mixers.attention import UViTBlock


def uvit_state_dict(depth, dim, seq_len, text_dim, mlp_hidden, qkv_bias=False, conv=True):
    """The reference U-ViT's tensors (libs/uvit_t2i.py): out blocks add `skip_linear`."""

    def block_layers(p):
        layers = {"norm1": dim, "attn.qkv": (3 * dim, dim) if qkv_bias else (3 * dim, dim, "no bias")}
        layers |= {"attn.proj": (dim, dim), "norm2": dim, "mlp.fc1": (mlp_hidden, dim), "mlp.fc2": (dim, mlp_hidden)}
        return layers | ({"skip_linear": (dim, 2 * dim)} if p.startswith("out_blocks") else {})

    return reference_state_dict(depth, dim, seq_len, text_dim, block_layers, conv, unit_weights=True)


def reference_forward(sd, x, context, n, depth, num_heads):
    """The reference UViT forward (libs/uvit_t2i.py); `n` is the network timestep (1..1000). Attention is
    softmax(QKᵀ/√d)·V per head, qkv's 3D outputs being [q | k | v], each split into heads in order."""

    def attention(h, p):
        q, k, v = (t.unflatten(-1, (num_heads, -1)).transpose(1, 2) for t in linear(sd, h, p + "qkv").chunk(3, -1))
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)  # (B, H, L, L)
        return linear(sd, (weights @ v).transpose(1, 2).flatten(2), p + "proj")

    def block(p, h, skip):
        if skip is not None:
            h = linear(sd, torch.cat([h, skip], dim=-1), p + "skip_linear")
        h = h + attention(norm(sd, h, p + "norm1"), p + "attn.")
        return h + linear(sd, F.gelu(linear(sd, norm(sd, h, p + "norm2"), p + "mlp.fc1")), p + "mlp.fc2")

    return reference_skeleton_forward(sd, x, context, n, depth, 2, block)


# Reference configs on the tiny skeleton: (depth, heads, qkv_bias, conv).
REFERENCE_CASES = {
    "4_layers_4_heads": (4, 4, False, True),
    "2_layers_2_heads_qkv_bias_no_conv": (2, 2, True, False),
    "mid_block_only_8_heads": (0, 8, False, True),
}


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_converted_tiny_model_matches_reference_forward(case):
    depth, heads, qkv_bias, conv = REFERENCE_CASES[case]
    config = dict(TINY, num_layers=depth, text_embed_dim=24, num_attention_heads=heads, qkv_bias=qkv_bias)
    model = UViTTransformer2DModel(**config, conv_out=conv).eval()
    sd = uvit_state_dict(depth, 32, 22, text_dim=24, mlp_hidden=128, qkv_bias=qkv_bias, conv=conv)
    model.load_state_dict(convert_uvit_reference_state_dict(sd), strict=True)

    gen = torch.Generator().manual_seed(1)
    x, context = torch.randn(3, 4, 8, 8, generator=gen), torch.randn(3, 5, 24, generator=gen)
    t = torch.tensor([0, 411, 999])  # diffusers timesteps; the network sees t + 1
    with torch.no_grad():
        ours = model(x, context, t).sample
        expected = reference_forward(sd, x, context, t + 1, depth, heads)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_uvit_s2_reference_layout_loads_one_to_one_and_matches():
    with torch.device("meta"):  # the weights come from `sd`
        model = UViTTransformer2DModel().eval()  # U-ViT-S/2
    sd = uvit_state_dict(12, 512, 334, text_dim=768, mlp_hidden=2048)
    # 11 top-level tensors, 11 per block in 13 blocks, skip_linear's 2 in 6 out blocks.
    assert len(sd) == 11 + 13 * 11 + 6 * 2 and sum(v.numel() for v in sd.values()) == 44_692_644
    converted = convert_uvit_reference_state_dict(sd)
    assert set(converted) == set(model.state_dict())
    model.load_state_dict(converted, strict=True, assign=True)

    gen = torch.Generator().manual_seed(2)
    x, context, t = torch.randn(1, 4, 32, 32, generator=gen), torch.randn(1, 77, 768, generator=gen), 499
    with torch.no_grad():
        ours = model(x, context, t).sample
        expected = reference_forward(sd, x, context, torch.tensor([t + 1]), 12, 8)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "key, cause",
    [
        ("in_blocks.0.l.weight", r"L-MLP checkpoint .*convert_lmlp_reference_state_dict"),
        ("mid_block.proj.bias", r"L-MLP checkpoint"),
        ("in_blocks.2.skip_linear.weight", r"Only out blocks have a skip_linear"),
        ("label_emb.weight", r"another U-ViT .*libs/uvit.py"),
        ("time_embed.0.weight", r"another U-ViT"),
        ("param_groups", r"the network's own state dict"),
    ],
)
def test_converter_names_the_likely_cause_of_a_foreign_key(key, cause):
    with pytest.raises(ValueError, match=rf"Unexpected key '{re.escape(key)}'.*{cause}"):
        convert_uvit_reference_state_dict({key: torch.zeros(1)})


def test_bad_heads_and_skips_are_refused():
    with pytest.raises(ValueError, match=r"hidden_size \(32\) must be divisible by num_attention_heads \(3\)"):
        UViTTransformer2DModel(**TINY, num_attention_heads=3)
    with pytest.raises(ValueError, match="num_attention_heads='8' cannot build a UViTTransformer2DModel"):
        UViTTransformer2DModel(**TINY, num_attention_heads="8")
    x = torch.zeros(1, 22, 32)
    with pytest.raises(ValueError, match="skip_linear=True but got skip=None"):
        UViTBlock(32, 4, 4.0, 1e-5, skip=True)(x)
    with pytest.raises(ValueError, match="skip_linear=False but got skip=a tensor"):
        UViTBlock(32, 4, 4.0, 1e-5)(x, x)


def test_in_block_costs_lmlp_table3_transformer_block_and_out_block_adds_skip_linear():
    with torch.device("meta"):
        blocks = {skip: UViTBlock(512, 8, 4.0, 1e-5, skip=skip) for skip in (False, True)}
        x = torch.zeros(1, 334, 512)
        macs = {}
        for skip, block in blocks.items():
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                block(x, x if skip else None)
            macs[skip] = counter.get_total_flops() // 2
    assert macs[False] == transformer_block_macs(334, 512, 4) == 1_164_906_496  # (4 + 2s)·L·D² + 2·L²·D
    assert complexity({}, family="uvit").block_macs == macs[False]
    # (4 + 2s)·D² weights (Table 3), two LayerNorms, the biases of proj, fc1 and fc2 (qkv has none).
    params = {skip: sum(p.numel() for p in block.parameters()) for skip, block in blocks.items()}
    assert params[False] == 12 * 512**2 + 4 * 512 + 512 + 2048 + 512 == 3_150_848
    assert macs[True] - macs[False] == 334 * 2 * 512 * 512
    assert params[True] - params[False] == 2 * 512 * 512 + 512


def test_the_registered_family_counts_lmlp_table4s_gmacs_without_the_attention_matmuls():
    family = FAMILIES["uvit"]
    assert family_of(UViTTransformer2DModel) is family
    assert (family.label, family.tag) == ("U-ViT", "u-vit")
    assert family.details(family.full_config({})) == ", 8 attention heads"
    # L-MLP Table 4's 14.78 GMACs for U-ViT-S/2 come from ptflops, whose module hooks cannot see the functional
    # attention: our count without QKᵀ and softmax(QKᵀ)·V is within 0.3% of it, and 16.23 G with them.
    counted = complexity({}, family="uvit")
    without_attention_matmuls = counted.macs - counted.num_blocks * 2 * 334**2 * 512
    assert without_attention_matmuls == pytest.approx(14.78e9, rel=3e-3)
    assert counted.macs == pytest.approx(16.23e9, rel=1e-3)
