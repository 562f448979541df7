"""MLP-Mixer, L-MLP Table 1's baseline A2: the block against a plain-torch re-statement of its paper, the named
config's size, exact complexity, gradients, the long-skip switch and any channel MLP in the channel-mixing slot."""

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

from diffusers_lmlp import MLPMixerTransformer2DModel
from diffusers_lmlp.complexity import complexity
from diffusers_lmlp.models.mixers.channel_mlp import CHANNEL_MLPS
from diffusers_lmlp.models.mixers.mlp_mixer import MLPMixerBlock


def mixer_reference(sd, x, skip):
    """MLP-Mixer eq. 1 over the block's state dict: U = X + W2 σ(W1 LN(X)) over tokens, Y = U + W4 σ(W3 LN(U))."""
    if skip is not None:
        x = x + skip
    n = layer_norm(x, sd["norm1.weight"], sd["norm1.bias"])
    # token mixing: every channel d is an L-vector n[:, d] mixed by the (D_S, L) and (L, D_S) matrices
    h = gelu(torch.einsum("sl,bld->bsd", sd["token_mlp.fc1.weight"], n) + sd["token_mlp.fc1.bias"][:, None])
    u = x + torch.einsum("ls,bsd->bld", sd["token_mlp.fc2.weight"], h) + sd["token_mlp.fc2.bias"][:, None]
    n = layer_norm(u, sd["norm2.weight"], sd["norm2.bias"])
    h = gelu(torch.einsum("cd,bld->blc", sd["channel_mlp.fc1.weight"], n) + sd["channel_mlp.fc1.bias"])
    return u + torch.einsum("dc,blc->bld", sd["channel_mlp.fc2.weight"], h) + sd["channel_mlp.fc2.bias"]


def closed_form_block_macs(config, seq_len):
    """The block's multiply-adds written from its paper: 2·L·D·(D_S + D_C)."""
    d = config["hidden_size"]
    return 2 * seq_len * d * (int(seq_len * config["token_mlp_ratio"]) + int(d * config["mlp_ratio"]))


@pytest.mark.parametrize("with_skip", [False, True])
def test_block_matches_plain_torch_restatement(with_skip):
    block = MLPMixerBlock(24, 11, token_mlp_ratio=1.5, mlp_ratio=3.0, norm_eps=EPS)
    check_block_matches_reference(block, mixer_reference, with_skip)


def test_a2_matches_a1_size():
    with torch.device("meta"):
        a2 = MLPMixerTransformer2DModel.from_named_config("A2")
    assert sum(p.numel() for p in a2.parameters()) == 23_486_038
    check_matches_a1(a2)
    mixer = a2.stack.mid_block
    assert mixer.token_mlp.fc1.out_features == 668 and mixer.channel_mlp.fc1.out_features == 1280


@pytest.mark.parametrize("long_skips", [True, False])
def test_tiny_model_is_counted_exactly(long_skips):
    torch.manual_seed(0)
    model = MLPMixerTransformer2DModel(**TINY, long_skips=long_skips)
    check_counted_exactly(model, closed_form_block_macs(model.config, TINY_SEQ_LEN))


def test_a2_is_counted_exactly():
    with torch.device("meta"):
        model = MLPMixerTransformer2DModel.from_named_config("A2")
    check_counted_exactly(model, closed_form_block_macs(model.config, A1_SEQ_LEN))


@pytest.mark.parametrize("channel_mlp", sorted(CHANNEL_MLPS))
def test_mixer_takes_any_channel_mlp(channel_mlp):
    torch.manual_seed(0)
    model = MLPMixerTransformer2DModel(**TINY, channel_mlp=channel_mlp)
    assert all(isinstance(block.channel_mlp, CHANNEL_MLPS[channel_mlp]) for block in model.stack.out_blocks)
    assert complexity(model).params == sum(p.numel() for p in model.parameters())


def test_every_parameter_gets_a_gradient():
    check_every_parameter_gets_a_gradient(MLPMixerTransformer2DModel)


def test_long_skips_off_builds_a_plain_stack():
    check_long_skips_off_builds_a_plain_stack(MLPMixerTransformer2DModel)


def test_long_skips_on_feed_out_blocks_the_in_blocks_outputs():
    check_long_skips_on_feed_out_blocks_the_in_blocks_outputs(MLPMixerTransformer2DModel)


def test_long_skips_setting_survives_save_and_load(tmp_path):
    check_long_skips_setting_survives_save_and_load(MLPMixerTransformer2DModel, tmp_path)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"token_mlp_ratio": 0.01}, r"token_mlp_ratio=0.01 gives a token MLP of int\(22 × 0.01\) = 0"),
        ({"token_mlp_ratio": -1.0}, "token_mlp_ratio must be a positive finite number"),
        ({"channel_mlp": "kan"}, "channel_mlp='kan' is not a channel MLP"),
        ({"long_skips": "yes"}, "long_skips must be True or False"),
    ],
)
def test_bad_config_raises_a_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        MLPMixerTransformer2DModel(**TINY, **overrides)
