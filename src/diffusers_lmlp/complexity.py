"""Parameter and forward-MAC accounting: the papers' complexity tables (L-MLP Table 3, MoE-MLP Table 1) as code.

A MAC is one multiply-add of a matrix product or convolution. As in the papers' tables ("lower-order terms such as
bias and normalization are omitted"), bias adds, LayerNorms, GELU, softmax, residual adds and the sinusoidal time
token are not counted; `torch.utils.flop_counter.FlopCounterMode` leaves out the same operations, so
`measured_macs` and `analytic_complexity` count the same thing.

Per block (L tokens, width D, joint-MLP ratio s, E experts and H heads for the MoE-MLP):

    L-MLP block        (2 + 2s)·L·D² + L²·D                                    L-MLP Table 3
    transformer block  (4 + 2s)·L·D² + 2·L²·D                                  L-MLP Table 3, for comparison
    MoE-MLP block      (2 + 2s)·L·D² + L²·D + H·E·L² + 2·H·E·L                 what `MoELinearAttention` computes

A model has num_layers + 1 blocks; around them come the patch embedding, the text adapter, the output Linear and
the optional 3×3 convolution.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin
from torch.utils.flop_counter import FlopCounterMode


@dataclass(frozen=True)
class Complexity:
    """Size and per-sample forward cost of a backbone.

    Args:
        params (`int`): Exact number of parameters, biases, norms and positional embedding included.
        macs (`int`): Forward multiply-adds per sample, blocks and token I/O together.
        block_macs (`int`): Forward multiply-adds of one block per sample.
        num_blocks (`int`): Number of blocks (num_layers + 1).
        seq_len (`int`): Tokens per block, L = 1 + text_seq_len + (sample_size / patch_size)².
    """

    params: int
    macs: int
    block_macs: int
    num_blocks: int
    seq_len: int


def lmlp_block_macs(seq_len: int, hidden_size: int, mlp_ratio: float) -> int:
    """MACs of one L-MLP block per sample: (2 + 2s)·L·D² + L²·D (L-MLP Table 3; 0.933 G at L=334, D=512, s=4).

    `right` and `merge` are two D×D Linears over L tokens (2·L·D²), the joint MLP is D → s·D → D (2s·L·D²) and the
    token mixer is one L×L matrix applied to D channels (L²·D). The MLP width is `int(D·s)`, as in `JointMLP`.

    Args:
        seq_len (`int`): Tokens L.
        hidden_size (`int`): Token width D.
        mlp_ratio (`float`): Joint-MLP ratio s.
    """
    inner = int(hidden_size * mlp_ratio)
    return 2 * seq_len * hidden_size**2 + 2 * seq_len * hidden_size * inner + seq_len**2 * hidden_size


def transformer_block_macs(seq_len: int, hidden_size: int, mlp_ratio: float) -> int:
    """MACs of one transformer (U-ViT) block per sample: (4 + 2s)·L·D² + 2·L²·D (L-MLP Table 3; 1.165 G at 334/512/4).

    The four D×D projections q, k, v and out cost 4·L·D², the MLP 2s·L·D², and QKᵀ and softmax(QKᵀ)·V L²·D each.
    The MoE-MLP paper's Table 1 writes (3 + 2s)·L·D² for the same block while giving it (4 + 2s)·D² parameters in
    the same row, which four projections cannot do; we follow L-MLP Table 3, whose 1.165 GMAC the tests check.

    Args:
        seq_len (`int`): Tokens L.
        hidden_size (`int`): Token width D.
        mlp_ratio (`float`): MLP ratio s.
    """
    inner = int(hidden_size * mlp_ratio)
    return 4 * seq_len * hidden_size**2 + 2 * seq_len * hidden_size * inner + 2 * seq_len**2 * hidden_size


def moe_block_macs(seq_len: int, hidden_size: int, mlp_ratio: float, num_experts: int, num_heads: int) -> int:
    """MACs of one MoE-MLP block per sample: the L-MLP block's plus H·E·L² + 2·H·E·L.

    On top of the L-MLP block, `MoELinearAttention` forms each head's mixed matrix Σ_e g_e·W_e (H·E·L²) and mixed
    bias Σ_e g_e·b_e (H·E·L), and applies each head's L→E gate to the head's channel mean (H·L·E; the mean itself is
    additions only). Applying the mixed matrices costs L²·(D/H) per head, L²·D in all, as the single L-MLP matrix.
    The paper (§3.4) puts the extra cost at H·E·L·D (2·H·E·L·D in its Table 1), but the mixture is over L×L
    matrices, so forming it costs H·E·L²; we count what the implementation computes.

    Args:
        seq_len (`int`): Tokens L.
        hidden_size (`int`): Token width D.
        mlp_ratio (`float`): Joint-MLP ratio s.
        num_experts (`int`): Experts E per head.
        num_heads (`int`): Heads H.
    """
    mixture = num_heads * num_experts * (seq_len**2 + seq_len)  # Σ_e g_e·W_e and Σ_e g_e·b_e
    gate = num_heads * seq_len * num_experts
    return lmlp_block_macs(seq_len, hidden_size, mlp_ratio) + mixture + gate


def _block_params(seq_len: int, hidden_size: int, mlp_ratio: float, num_experts: int | None, num_heads: int) -> int:
    """Parameters of one block; `num_experts=None` is the L-MLP block's single token-mixing `nn.Linear(L, L)`."""
    inner = int(hidden_size * mlp_ratio)
    norms = 2 * hidden_size + 2 * seq_len  # channel_norm (D weights + D biases), token_norm (L + L)
    channel = 2 * (hidden_size**2 + hidden_size)  # right, merge
    joint_mlp = hidden_size * inner + inner + inner * hidden_size + hidden_size
    if num_experts is None:
        left = seq_len**2 + seq_len
    else:  # H·E experts (L×L weight, L bias) and H gates (nn.Linear(L, E): E×L weight, E bias)
        left = num_heads * num_experts * (seq_len**2 + seq_len + seq_len + 1)
    return norms + channel + joint_mlp + left


def analytic_complexity(config: Mapping | ConfigMixin) -> Complexity:
    """Parameters and per-sample forward MACs of an `LMLPTransformer2DModel` or `MoEMLPModel`, from its config.

    A config with `num_experts` and `num_heads` is a MoE-MLP one. Token I/O adds the patch embedding (N·D·C·p²),
    the text adapter (T·text_embed_dim·D), the output Linear over all L tokens (L·D·p²·C_out) and the optional
    3×3 convolution (H·W·C_out²·9) to the blocks' MACs.

    Args:
        config (`Mapping` or `ConfigMixin`): A model's `config` (all its keys, as `model.config` has them), or the
            model itself.

    Returns:
        [`Complexity`]: exact parameter count and forward MACs per sample.

    Example:
        ```py
        analytic_complexity(LMLPTransformer2DModel().config)  # F2: 47,139,122 params, ~15.89 GMAC
        ```
    """
    if isinstance(config, ConfigMixin):
        config = config.config
    side, patch, channels = config["sample_size"], config["patch_size"], config["in_channels"]
    out_channels = config["out_channels"] or channels
    hidden, ratio, num_layers = config["hidden_size"], config["mlp_ratio"], config["num_layers"]
    text_dim, text_len = config["text_embed_dim"], config["text_seq_len"]
    num_experts, num_heads = config.get("num_experts"), config.get("num_heads", 1)

    num_patches = (side // patch) ** 2
    seq_len = 1 + text_len + num_patches
    num_blocks = num_layers + 1
    if num_experts is None:
        block_macs = lmlp_block_macs(seq_len, hidden, ratio)
    else:
        block_macs = moe_block_macs(seq_len, hidden, ratio, num_experts, num_heads)
    block_params = _block_params(seq_len, hidden, ratio, num_experts, num_heads)

    pixels_per_token = patch * patch * out_channels
    embed_params = (hidden * channels * patch * patch + hidden) + (text_dim * hidden + hidden) + seq_len * hidden
    head_params = 2 * hidden + (hidden * pixels_per_token + pixels_per_token)
    io_macs = num_patches * hidden * channels * patch * patch + text_len * text_dim * hidden
    io_macs += seq_len * hidden * pixels_per_token  # the Linear runs before the time and text tokens are dropped
    if config["conv_out"]:
        head_params += out_channels * out_channels * 9 + out_channels
        io_macs += side * side * out_channels * out_channels * 9

    return Complexity(
        params=embed_params + num_blocks * block_params + head_params,
        macs=num_blocks * block_macs + io_macs,
        block_macs=block_macs,
        num_blocks=num_blocks,
        seq_len=seq_len,
    )


def measured_macs(model: torch.nn.Module, batch_size: int = 1) -> float:
    """Forward MACs per sample as torch's own `torch.utils.flop_counter.FlopCounterMode` counts them (FLOPs / 2).

    Runs one forward pass without gradients on zero latents, zero text states and timestep 0, on the model's
    device and dtype.

    Args:
        model (`torch.nn.Module`): An `LMLPTransformer2DModel` or `MoEMLPModel`.
        batch_size (`int`, *optional*, defaults to 1): Samples in the forward pass; the count is divided by it.

    Returns:
        `float`: multiply-adds per sample.
    """
    config = model.config
    weight = next(model.parameters())
    side = config.sample_size
    latents = weight.new_zeros(batch_size, config.in_channels, side, side)
    text_states = weight.new_zeros(batch_size, config.text_seq_len, config.text_embed_dim)
    timestep = torch.zeros(batch_size, dtype=torch.long, device=weight.device)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(latents, text_states, timestep)
    return counter.get_total_flops() / 2 / batch_size
