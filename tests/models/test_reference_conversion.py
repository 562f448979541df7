"""Fidelity to zizhao-hu/L-MLP's `libs/f2.py` and `libs/uvit_t2i.py`: re-statements, the converters, U-ViT's cost."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from plain_torch import TINY, reference_skeleton_forward
from torch.utils.flop_counter import FlopCounterMode

from diffusers_lmlp import (
    LMLPTransformer2DModel,
    UViTTransformer2DModel,
    convert_lmlp_reference_state_dict,
    convert_uvit_reference_state_dict,
)
from diffusers_lmlp.complexity import complexity, transformer_block_macs
from diffusers_lmlp.models.families import FAMILIES, family_of
from diffusers_lmlp.models.mixers.attention import UViTBlock


def reference_state_dict(depth, dim, seq_len, text_dim, block_layers, conv=True, unit_weights=False):
    """Random tensors under a reference network's keys; `block_layers(prefix)`: LayerNorm widths, Linear (out, in)."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=0.05, offset=0.0):
        return offset + scale * torch.randn(*shape, generator=gen)

    sd = {"pos_embed": rand(1, seq_len, dim), "patch_embed.proj.weight": rand(dim, 4, 2, 2)}
    layers = {"patch_embed.proj": (dim,), "context_embed": (dim, text_dim), "norm": dim, "decoder_pred": (16, dim)}
    if conv:
        sd["final_layer.weight"], layers["final_layer"] = rand(4, 4, 3, 3), (4,)
    for p in ["mid_block.", *(f"{half}_blocks.{i}." for half in ("in", "out") for i in range(depth // 2))]:
        layers |= {p + name: shape for name, shape in block_layers(p).items()}
    for name, shape in layers.items():
        if isinstance(shape, int):  # a LayerNorm
            sd |= {f"{name}.weight": rand(shape, offset=1.0), f"{name}.bias": rand(shape)}
            continue
        if len(shape) > 1:
            sd[f"{name}.weight"] = rand(*shape[:2], scale=shape[1] ** -0.5 if unit_weights else 0.05)
        if len(shape) != 3:
            sd[f"{name}.bias"] = rand(shape[0])
    return sd


def lmlp_state_dict(depth, dim, seq_len, text_dim, mlp_hidden):
    """The reference UL-MLP's tensors (libs/f2.py)."""
    block = {"norm1": dim, "norm2": seq_len, "l": (seq_len, seq_len), "r": (dim, dim), "proj": (dim, dim)}
    block |= {"mlp.fc1": (mlp_hidden, dim), "mlp.fc2": (dim, mlp_hidden)}
    return reference_state_dict(depth, dim, seq_len, text_dim, lambda p: block)


def uvit_state_dict(depth, dim, seq_len, text_dim, mlp_hidden, qkv_bias=False, conv=True):
    """The reference U-ViT's tensors (libs/uvit_t2i.py): out blocks add `skip_linear`."""

    def block_layers(p):
        layers = {"norm1": dim, "attn.qkv": (3 * dim, dim) if qkv_bias else (3 * dim, dim, "no bias")}
        layers |= {"attn.proj": (dim, dim), "norm2": dim, "mlp.fc1": (mlp_hidden, dim), "mlp.fc2": (dim, mlp_hidden)}
        return layers | ({"skip_linear": (dim, 2 * dim)} if p.startswith("out_blocks") else {})

    return reference_state_dict(depth, dim, seq_len, text_dim, block_layers, conv, unit_weights=True)


def linear(sd, h, name):
    return F.linear(h, sd[f"{name}.weight"], sd.get(f"{name}.bias"))


def norm(sd, h, name):
    return F.layer_norm(h, h.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"])


def lmlp_forward(sd, x, context, n, depth):
    """The reference ULMLP forward; `n` is the network timestep (1..1000)."""

    def block(p, h, skip):
        h = h if skip is None else h + skip
        left = linear(sd, norm(sd, h.transpose(1, 2), p + "norm2"), p + "l").transpose(1, 2)
        h = norm(sd, h, p + "norm1")
        h = h + linear(sd, left + linear(sd, h, p + "r"), p + "proj")
        return h + linear(sd, F.gelu(linear(sd, norm(sd, h, p + "norm1"), p + "mlp.fc1")), p + "mlp.fc2")

    return reference_skeleton_forward(sd, x, context, n, depth, 2, block)


def uvit_forward(sd, x, context, n, depth, num_heads=8):
    """The reference UViT forward: softmax(QKᵀ/√d)·V per head, qkv's outputs being [q | k | v], each head in order."""

    def attention(h, p):
        q, k, v = (t.unflatten(-1, (num_heads, -1)).transpose(1, 2) for t in linear(sd, h, p + "qkv").chunk(3, -1))
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)  # (B, H, L, L)
        return linear(sd, (weights @ v).transpose(1, 2).flatten(2), p + "proj")

    def block(p, h, skip):
        h = h if skip is None else linear(sd, torch.cat([h, skip], dim=-1), p + "skip_linear")
        h = h + attention(norm(sd, h, p + "norm1"), p + "attn.")
        return h + linear(sd, F.gelu(linear(sd, norm(sd, h, p + "norm2"), p + "mlp.fc1")), p + "mlp.fc2")

    return reference_skeleton_forward(sd, x, context, n, depth, 2, block)


def tiny_inputs():
    gen = torch.Generator().manual_seed(1)
    # diffusers scheduler timesteps; the reference network sees t + 1
    return torch.randn(3, 4, 8, 8, generator=gen), torch.randn(3, 5, 24, generator=gen), torch.tensor([0, 411, 999])


def test_converted_tiny_lmlp_matches_reference_forward_bit_for_bit_in_fp32_and_under_bf16_autocast():
    model = LMLPTransformer2DModel(**{**TINY, "num_layers": 4, "text_embed_dim": 24}).eval()
    sd = lmlp_state_dict(depth=4, dim=32, seq_len=22, text_dim=24, mlp_hidden=128)
    # DDP's "module." prefix is stripped
    model.load_state_dict(convert_lmlp_reference_state_dict({f"module.{k}": v for k, v in sd.items()}), strict=True)
    streams = []
    for block in model.stack.in_blocks:
        block.register_forward_hook(lambda module, args, out: streams.append(out.dtype))
    x, context, t = tiny_inputs()
    with torch.no_grad():
        # The same ops in the same order and layouts: the same bits.
        assert torch.equal(model(x, context, t).sample, lmlp_forward(sd, x, context, t + 1, depth=4))
        # The reference's torch.cat joins the bf16 patches and text with the float32 time token and adds the float32
        # pos_embed: under autocast the stream is float32, and every block's residual add stays so.
        streams.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours, expected = model(x, context, t).sample, lmlp_forward(sd, x, context, t + 1, depth=4)
        assert streams == [torch.float32, torch.float32] and torch.equal(ours, expected)
        streams.clear()
        model.to(torch.bfloat16)(x, context, t)  # with bf16 weights and no autocast, everything is bf16
    assert streams == [torch.bfloat16, torch.bfloat16]


@pytest.mark.parametrize(
    "depth, heads, qkv_bias, conv", [(4, 4, False, True), (2, 2, True, False), (0, 8, False, True)]
)  # the third: the mid block only
def test_converted_tiny_uvit_matches_reference_forward(depth, heads, qkv_bias, conv):
    config = dict(TINY, num_layers=depth, text_embed_dim=24, num_attention_heads=heads, qkv_bias=qkv_bias)
    model = UViTTransformer2DModel(**config, conv_out=conv).eval()
    sd = uvit_state_dict(depth, 32, 22, text_dim=24, mlp_hidden=128, qkv_bias=qkv_bias, conv=conv)
    prefix = "module." if qkv_bias else ""  # DDP's, stripped
    model.load_state_dict(convert_uvit_reference_state_dict({prefix + k: v for k, v in sd.items()}), strict=True)
    x, context, t = tiny_inputs()
    ours, expected = model(x, context, t).sample, uvit_forward(sd, x, context, t + 1, depth, heads)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


# The papers' models: the reference's state dict, its tensors (§A.4: 249 for depth 16; U-ViT: 11 + 13 blocks' 11 + 6
# skip_linears' 2), the tolerance (F2-deep: bit for bit, as the merge GEMM rounds by Z's layout: the reference's l+r).
FULL_SIZE = {
    "F2-deep": (LMLPTransformer2DModel, lmlp_state_dict, lmlp_forward, 16, 249, 47_139_122, 0),
    "U-ViT-S/2": (UViTTransformer2DModel, uvit_state_dict, uvit_forward, 12, 11 + 13 * 11 + 6 * 2, 44_692_644, 1e-5),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", FULL_SIZE)
def test_the_papers_reference_layouts_load_one_to_one_and_match(name):
    model_class, state_dict, forward, depth, num_tensors, num_params, tolerance = FULL_SIZE[name]
    with torch.device("meta"):  # the weights come from `sd`: skip initialising them
        model = model_class().eval()
    sd = state_dict(depth, 512, 334, text_dim=768, mlp_hidden=2048)
    assert len(sd) == num_tensors and sum(v.numel() for v in sd.values()) == num_params
    converted = (convert_lmlp_reference_state_dict if depth == 16 else convert_uvit_reference_state_dict)(sd)
    assert set(converted) == set(model.state_dict())
    model.load_state_dict(converted, strict=True, assign=True)
    gen = torch.Generator().manual_seed(2)
    x, context = torch.randn(1, 4, 32, 32, generator=gen), torch.randn(1, 77, 768, generator=gen)
    with torch.no_grad():
        ours, expected = model(x, context, 499).sample, forward(sd, x, context, torch.tensor([500]), depth)
    torch.testing.assert_close(ours, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    "convert, key, cause",
    [
        (convert_lmlp_reference_state_dict, "in_blocks.0.attn.qkv.weight", "U-ViT"),
        (convert_uvit_reference_state_dict, "in_blocks.0.l.weight", "L-MLP checkpoint .*convert_lmlp_reference_state"),
        (convert_uvit_reference_state_dict, "mid_block.proj.bias", "L-MLP checkpoint"),
        (convert_uvit_reference_state_dict, "in_blocks.2.skip_linear.weight", "Only out blocks have a skip_linear"),
        (convert_uvit_reference_state_dict, "label_emb.weight", "another U-ViT .*libs/uvit.py"),
        (convert_uvit_reference_state_dict, "time_embed.0.weight", "another U-ViT"),
        (convert_uvit_reference_state_dict, "param_groups", "the network's own state dict"),
    ],
)
def test_converters_name_the_likely_cause_of_a_foreign_key(convert, key, cause):
    with pytest.raises(ValueError, match=rf"Unexpected key '{re.escape(key)}'.*{cause}"):
        convert({key: torch.zeros(3, 1)})


def test_uvit_costs_lmlp_table3s_transformer_block_and_table4s_gmacs_without_the_attention_matmuls():
    macs, params = {}, {}
    with torch.device("meta"):
        for skip in (False, True):
            block, x = UViTBlock(512, 8, 4.0, 1e-5, skip=skip), torch.zeros(1, 334, 512)
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                block(x, x if skip else None)
            macs[skip], params[skip] = counter.get_total_flops() // 2, sum(p.numel() for p in block.parameters())
    counted = complexity({}, family="uvit")  # a block: (4 + 2s)·L·D² + 2·L²·D
    assert counted.block_macs == macs[False] == transformer_block_macs(334, 512, 4) == 1_164_906_496
    # (4 + 2s)·D² weights (Table 3), two LayerNorms, the biases of proj, fc1 and fc2 (qkv has none).
    assert params[False] == 12 * 512**2 + 4 * 512 + 512 + 2048 + 512 == 3_150_848
    assert (macs[True] - macs[False], params[True] - params[False]) == (334 * 2 * 512 * 512, 2 * 512 * 512 + 512)
    family = FAMILIES["uvit"]
    assert family_of(UViTTransformer2DModel) is family and (family.label, family.tag) == ("U-ViT", "u-vit")
    assert family.details(family.full_config({})) == ", 8 attention heads"
    # L-MLP Table 4's 14.78 GMACs for U-ViT-S/2 come from ptflops, whose module hooks cannot see the functional
    # attention: our count without QKᵀ and softmax(QKᵀ)·V is within 0.3% of it, and 16.23 G with them.
    assert counted.macs - counted.num_blocks * 2 * 334**2 * 512 == pytest.approx(14.78e9, rel=3e-3)
    assert counted.macs == pytest.approx(16.23e9, rel=1e-3)
    x = torch.zeros(1, 22, 32)  # a block refuses a skip it was not built for
    with pytest.raises(ValueError, match="skip_linear=True but got skip=None"):
        UViTBlock(32, 4, 4.0, 1e-5, skip=True)(x)
    with pytest.raises(ValueError, match="skip_linear=False but got skip=a tensor"):
        UViTBlock(32, 4, 4.0, 1e-5)(x, x)
