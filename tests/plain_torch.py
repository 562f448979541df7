"""Plain-torch re-statements (LayerNorm, GELU, the reference U-ViT / UL-MLP skeleton) and the block tests' checks."""

import math

import torch
import torch.nn.functional as F

from diffusers_lmlp import LMLPTransformer2DModel
from diffusers_lmlp.complexity import complexity


TINY = dict(
    sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, text_embed_dim=16, text_seq_len=5
)
TINY_SEQ_LEN = 22  # 1 time token + 5 text tokens + (8 / 2)² patches
A1_PARAMS = 23_484_738  # L-MLP Table 1's A1, the size its baselines are matched to
A1_SEQ_LEN = 334  # COCO: 1 time token + 77 text tokens + (32 / 2)² patches
EPS = 1e-5


def randomize_(module, seed):
    """Random values everywhere (biases and norms too), so that no term can hide behind a zero or unit init."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen) + (1.0 if p.ndim == 1 else 0.0))


def layer_norm(x, weight, bias):
    """LayerNorm over the last axis, written out."""
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + EPS) * weight + bias


def gelu(x):
    return 0.5 * x * (1 + torch.erf(x / 2**0.5))


def tiny_inputs(batch=2):
    """Latents, text states and timesteps for a model built with TINY."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(batch, 4, 8, 8, generator=gen), torch.randn(batch, 5, 16, generator=gen), torch.tensor([3, 700])


def record_skips(model):
    """The skip argument every block is called with, in call order."""
    calls = []
    blocks = [*model.stack.in_blocks, model.stack.mid_block, *model.stack.out_blocks]
    for index, block in enumerate(blocks):
        block.register_forward_hook(lambda module, args, out, i=index: calls.append((i, args[1], out)))
    return calls


def check_block_matches_reference(block, reference, with_skip):
    """A random (24-wide, 11-token) block against its re-statement over its state dict."""
    randomize_(block, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 11, 24, generator=gen)
    skip = torch.randn(3, 11, 24, generator=gen) if with_skip else None
    with torch.no_grad():
        out = block(x, skip)
        expected = reference(dict(block.state_dict()), x, skip)
    assert out.shape == (3, 11, 24), out.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def check_counted_exactly(model, block_macs):
    """The counted parameters are the model's, and a block's counted MACs are the paper's closed form."""
    counted = complexity(model)
    assert (counted.params, counted.block_macs) == (sum(p.numel() for p in model.parameters()), block_macs)


def check_matches_a1(model):
    """A named config on A1's skeleton (COCO tokens, D = 512, 13 blocks, no long skips), within 3% of A1's size."""
    with torch.device("meta"):
        a1 = LMLPTransformer2DModel.from_named_config("A1")
    assert sum(p.numel() for p in a1.parameters()) == A1_PARAMS
    size = sum(p.numel() for p in model.parameters())
    assert abs(size / A1_PARAMS - 1) < 0.03, size
    assert model.seq_len == A1_SEQ_LEN and model.config.hidden_size == 512
    assert len(model.stack.in_blocks) == len(model.stack.out_blocks) == 6
    assert model.stack.long_skips is False


def check_long_skips_off_builds_a_plain_stack(model_class):
    """With long_skips=False every block gets skip=None, and the stack is its blocks called one after another."""
    torch.manual_seed(0)
    model = model_class(**dict(TINY, num_layers=4), long_skips=False).eval()
    assert model_class.long_skips(model.config) is False
    calls, stack_io = record_skips(model), []
    model.stack.register_forward_hook(lambda module, args, out: stack_io.append((args[0], out)))
    with torch.no_grad():
        model(*tiny_inputs())
        assert [i for i, _, _ in calls] == [0, 1, 2, 3, 4], [i for i, _, _ in calls]
        assert all(skip is None for _, skip, _ in calls)
        x, stack_out = stack_io[0]
        for block in [*model.stack.in_blocks, model.stack.mid_block, *model.stack.out_blocks]:
            x = block(x, None)
    torch.testing.assert_close(x, stack_out, rtol=0, atol=0)


def check_long_skips_on_feed_out_blocks_the_in_blocks_outputs(model_class):
    torch.manual_seed(0)
    model = model_class(**dict(TINY, num_layers=4)).eval()
    assert model_class.long_skips(model.config) is True
    calls = record_skips(model)
    with torch.no_grad():
        model(*tiny_inputs())
    outputs = {i: out for i, _, out in calls}
    assert all(skip is None for i, skip, _ in calls if i <= 2)
    assert calls[3][1] is outputs[1] and calls[4][1] is outputs[0]  # out block i gets in block n-1-i


def check_long_skips_setting_survives_save_and_load(model_class, path):
    torch.manual_seed(0)
    model = model_class(**TINY, long_skips=False).eval()
    model.save_pretrained(path)
    loaded = model_class.from_pretrained(path).eval()
    assert loaded.config.long_skips is False and loaded.stack.long_skips is False
    with torch.no_grad():
        torch.testing.assert_close(loaded(*tiny_inputs()).sample, model(*tiny_inputs()).sample, rtol=0, atol=0)


def reference_skeleton_forward(sd, x, context, n, depth, patch, block):
    """The reference network (libs/uvit_t2i.py, libs/f2.py) around `block(prefix, h, skip)` on a reference-keyed `sd`
    (time token of `n` in 1..1000, cos half first; LIFO long skips; (p1, p2, C) unpatchify; optional `final_layer`)."""
    batch, channels, height, _ = x.shape
    dim = sd["pos_embed"].shape[-1]
    extras = 1 + context.shape[1]
    h = F.conv2d(x, sd["patch_embed.proj.weight"], sd["patch_embed.proj.bias"], stride=patch)
    h = h.flatten(2).transpose(1, 2)
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = n[:, None].float() * freqs[None]
    time_token = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)[:, None, :]
    ctx = F.linear(context, sd["context_embed.weight"], sd["context_embed.bias"])
    h = torch.cat([time_token, ctx, h], dim=1) + sd["pos_embed"]
    skips = []
    for i in range(depth // 2):
        h = block(f"in_blocks.{i}.", h, None)
        skips.append(h)
    h = block("mid_block.", h, None)
    for i in range(depth // 2):
        h = block(f"out_blocks.{i}.", h, skips.pop())
    h = F.layer_norm(h, (dim,), sd["norm.weight"], sd["norm.bias"])
    h = F.linear(h, sd["decoder_pred.weight"], sd["decoder_pred.bias"])[:, extras:]
    grid = height // patch
    # einops 'B (h w) (p1 p2 C) -> B C (h p1) (w p2)'
    h = h.reshape(batch, grid, grid, patch, patch, channels).permute(0, 5, 1, 3, 2, 4)
    h = h.reshape(batch, channels, grid * patch, grid * patch)
    if "final_layer.weight" in sd:
        h = F.conv2d(h, sd["final_layer.weight"], sd["final_layer.bias"], padding=1)
    return h
