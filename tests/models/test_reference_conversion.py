"""Fidelity to the reference UL-MLP (zizhao-hu/L-MLP `libs/f2.py`): a plain-torch re-statement on reference keys."""

import re

import pytest
import torch
import torch.nn.functional as F
from plain_torch import reference_skeleton_forward

from diffusers_lmlp import LMLPTransformer2DModel, convert_lmlp_reference_state_dict, convert_uvit_reference_state_dict


def reference_state_dict(depth, dim, seq_len, patch, channels, text_dim, block_tensors, conv=True, unit_weights=False):
    """Random tensors under a reference network's keys (§A.4, §B.1); `unit_weights` scales weights by fan-in^-½."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=0.05, offset=0.0):
        return offset + scale * torch.randn(*shape, generator=gen)

    def weight(out_features, in_features):
        return rand(out_features, in_features, scale=in_features**-0.5 if unit_weights else 0.05)

    sd = {
        "pos_embed": rand(1, seq_len, dim),
        "patch_embed.proj.weight": rand(dim, channels, patch, patch),
        "patch_embed.proj.bias": rand(dim),
        "context_embed.weight": weight(dim, text_dim),
        "context_embed.bias": rand(dim),
        "norm.weight": rand(dim, offset=1.0),
        "norm.bias": rand(dim),
        "decoder_pred.weight": weight(patch * patch * channels, dim),
        "decoder_pred.bias": rand(patch * patch * channels),
    }
    if conv:
        sd |= {"final_layer.weight": rand(channels, channels, 3, 3), "final_layer.bias": rand(channels)}
    prefixes = [f"in_blocks.{i}." for i in range(depth // 2)] + ["mid_block."]
    for p in prefixes + [f"out_blocks.{i}." for i in range(depth // 2)]:
        sd |= block_tensors(p, rand, weight)
    return sd


def lmlp_state_dict(depth, dim, seq_len, patch, channels, text_dim, mlp_hidden):
    """The reference UL-MLP's tensors (libs/f2.py)."""

    def block_tensors(p, rand, weight):
        return {
            p + "norm1.weight": rand(dim, offset=1.0),
            p + "norm1.bias": rand(dim),
            p + "norm2.weight": rand(seq_len, offset=1.0),
            p + "norm2.bias": rand(seq_len),
            p + "l.weight": weight(seq_len, seq_len),
            p + "l.bias": rand(seq_len),
            p + "r.weight": weight(dim, dim),
            p + "r.bias": rand(dim),
            p + "proj.weight": weight(dim, dim),
            p + "proj.bias": rand(dim),
            p + "mlp.fc1.weight": weight(mlp_hidden, dim),
            p + "mlp.fc1.bias": rand(mlp_hidden),
            p + "mlp.fc2.weight": weight(dim, mlp_hidden),
            p + "mlp.fc2.bias": rand(dim),
        }

    return reference_state_dict(depth, dim, seq_len, patch, channels, text_dim, block_tensors)


def reference_forward(sd, x, context, n, depth, patch):
    """The reference ULMLP forward; `n` is the network timestep (1..1000)."""
    dim = sd["pos_embed"].shape[-1]
    seq_len = sd["pos_embed"].shape[1]

    def block(p, h, skip):
        if skip is not None:
            h = h + skip
        xt = h.transpose(1, 2)
        h = F.layer_norm(h, (dim,), sd[p + "norm1.weight"], sd[p + "norm1.bias"])
        xt = F.layer_norm(xt, (seq_len,), sd[p + "norm2.weight"], sd[p + "norm2.bias"])
        left = F.linear(xt, sd[p + "l.weight"], sd[p + "l.bias"]).transpose(1, 2)
        right = F.linear(h, sd[p + "r.weight"], sd[p + "r.bias"])
        h = h + F.linear(left + right, sd[p + "proj.weight"], sd[p + "proj.bias"])
        hn = F.layer_norm(h, (dim,), sd[p + "norm1.weight"], sd[p + "norm1.bias"])
        mlp = F.linear(
            F.gelu(F.linear(hn, sd[p + "mlp.fc1.weight"], sd[p + "mlp.fc1.bias"])),
            *(sd[p + "mlp.fc2.weight"], sd[p + "mlp.fc2.bias"]),
        )
        return h + mlp

    return reference_skeleton_forward(sd, x, context, n, depth, patch, block)


TINY = dict(
    sample_size=8, patch_size=2, hidden_size=32, num_layers=4, mlp_ratio=4.0, text_embed_dim=24, text_seq_len=5
)


def test_converted_tiny_model_matches_reference_forward_bit_for_bit_in_fp32_and_under_bf16_autocast():
    model = LMLPTransformer2DModel(**TINY).eval()
    sd = lmlp_state_dict(depth=4, dim=32, seq_len=22, patch=2, channels=4, text_dim=24, mlp_hidden=128)
    model.load_state_dict(convert_lmlp_reference_state_dict(sd), strict=True)
    streams = []
    for block in model.stack.in_blocks:
        block.register_forward_hook(lambda module, args, out: streams.append(out.dtype))
    gen = torch.Generator().manual_seed(1)
    x, context = torch.randn(3, 4, 8, 8, generator=gen), torch.randn(3, 5, 24, generator=gen)
    t = torch.tensor([0, 411, 999])  # diffusers scheduler timesteps; the reference network sees t + 1
    with torch.no_grad():
        # The same ops in the same order and layouts: the same bits.
        assert torch.equal(model(x, context, t).sample, reference_forward(sd, x, context, t + 1, depth=4, patch=2))
        # The reference's torch.cat joins the bf16 patches and text with the float32 time token and adds the float32
        # pos_embed: under autocast the stream is float32, and every block's residual add stays so.
        streams.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = model(x, context, t).sample
            expected = reference_forward(sd, x, context, t + 1, depth=4, patch=2)
        assert streams == [torch.float32, torch.float32] and torch.equal(ours, expected)
        streams.clear()
        model.to(torch.bfloat16)(x, context, t)  # with bf16 weights and no autocast, everything is bf16
    assert streams == [torch.bfloat16, torch.bfloat16]


@pytest.mark.slow
def test_f2_reference_layout_loads_one_to_one_and_matches():
    model = LMLPTransformer2DModel().eval()  # F2
    sd = lmlp_state_dict(depth=16, dim=512, seq_len=334, patch=2, channels=4, text_dim=768, mlp_hidden=2048)
    assert len(sd) == 249 and sum(v.numel() for v in sd.values()) == 47_139_122  # §A.4: 249 tensors for depth 16
    converted = convert_lmlp_reference_state_dict(sd)
    assert set(converted) == set(model.state_dict())
    model.load_state_dict(converted, strict=True)

    gen = torch.Generator().manual_seed(2)
    x, context, t = (
        torch.randn(1, 4, 32, 32, generator=gen),
        torch.randn(1, 77, 768, generator=gen),
        torch.tensor([499]),
    )
    with torch.no_grad():
        ours = model(x, context, t).sample
        expected = reference_forward(sd, x, context, t + 1, depth=16, patch=2)
    # Bit for bit: at this width the merge GEMM rounds by Z's layout, which must be the reference's (left + right).
    assert torch.equal(ours, expected)


def test_converters_strip_ddp_prefix_and_refuse_each_others_keys():
    lmlp, uvit = convert_lmlp_reference_state_dict, convert_uvit_reference_state_dict
    cases = [
        (lmlp, "in_blocks.3.mlp.fc2.bias", "stack.in_blocks.3.joint_mlp.fc2.bias", "in_blocks.0.attn.qkv.weight"),
        (uvit, "out_blocks.1.skip_linear.bias", "stack.out_blocks.1.skip_linear.bias", "in_blocks.0.l.weight"),
    ]
    for convert, key, ours, foreign in cases:
        sd = {"module.context_embed.weight": torch.zeros(2, 2), f"module.{key}": torch.zeros(2)}
        assert set(convert(sd)) == {"embed.text_adapter.weight", ours}
        with pytest.raises(ValueError, match=rf"Unexpected key '{re.escape(foreign)}'.*(U-ViT|L-MLP)"):
            convert({foreign: torch.zeros(3, 1)})
