"""The named configurations of every block family: data only (no torch, no diffusers), so that command lines can list
and check them without importing a model.

Each family's model class takes its entry of `NAMED_CONFIGS` as its `named_configs` (`Model.from_named_config(name)`);
`diffusers_lmlp.models.families.named_configs()` joins them across families.
"""

from typing import Any


# The skeleton of the shapes world's small models (`shapes-S`, `shapes-moe-S`; diffusers_lmlp.shapes): 8×8×8 latents of
# 32 px images in 2×2 patches (16 image tokens), 10 tokens of its 64-wide text encoder, D = 96, 8 + 1 blocks.
SHAPES_SMALL = dict(
    sample_size=8, patch_size=2, in_channels=8, hidden_size=96, num_layers=8, text_embed_dim=64, text_seq_len=10
)

# The skeleton of the emoji world's model (`emoji-S`; diffusers_lmlp.emoji): 8×8×8 latents of 32 px pictures in 2×2
# patches (16 image tokens), 25 tokens of the emoji CLIP's 128-wide text tower, D = 192, 12 + 1 blocks.
EMOJI_SMALL = dict(
    sample_size=8, patch_size=2, in_channels=8, hidden_size=192, num_layers=12, text_embed_dim=128, text_seq_len=25
)

# L-MLP Table 1 (§5.2): the design ablation, on the COCO skeleton (32×32×4 latents, patch 2, D = 512, 77 text
# tokens, L = 334). The paper trains each group at a matched size "by adjusting model hyperparameters" and says
# (§4.1) it sizes an L-MLP by the MLP scale of FNN_Z; so within a group only the depth-12 (13-block) skeleton and
# one width vary: the hemispheres' MLP width where there is no second stage, the joint MLP's scale s otherwise.
# Readings where the paper is silent (Figure 7 is not in its text):
# - "1-layer MLP" hemispheres (A1, B1–B3, C1) are Linear → GELU → Linear, one hidden layer.
# - Table 1 (f) says D2 has no U-Net skips, so nothing before F1 has long skips (A1–E2 are plain stacks).
# - F2-deep is the reference code (its long skip is added at the block's input), so that placement is "Second
#   Stage": the skip joins the residual stream that the second stage reads. "First Stage" (F1) adds it to what
#   the two hemispheres read only.
# - B2's "GLUs": the left hemisphere gated by the sigmoid of the right (Dauphin et al.'s GLU across the
#   hemispheres); E1's product gates the right hemisphere by GELU(left) (the footnote: GELU on the left only).
# - A1 appears in group (a) at 23.5M and in group (c) at 45M with different FIDs: "A1" is the 23.5M row, "A1-45M"
#   the 45M one.
_PLAIN = dict(num_layers=12, long_skip=None)  # the depth-12 skeleton without long skips
_NO_SECOND_STAGE = dict(_PLAIN, mlp_ratio=None)  # first stage only, sized by the hemispheres' MLP width
_LINEAR_HEMISPHERES = dict(_PLAIN, mlp_ratio=5.2)  # Linear hemispheres, sized by s as Table 3's F2 block
TABLE_1 = {
    "A1": dict(_NO_SECOND_STAGE, lateral_mlp_ratio=2.0),
    "B1": dict(_NO_SECOND_STAGE, lateral_mlp_ratio=2.0, merging="prod"),
    "B2": dict(_NO_SECOND_STAGE, lateral_mlp_ratio=2.0, merging="glu"),
    "B3": dict(_NO_SECOND_STAGE, lateral_mlp_ratio=2.35, merge_proj=False),
    "A1-45M": dict(_NO_SECOND_STAGE, lateral_mlp_ratio=4.15),
    "C1": dict(_PLAIN, lateral_mlp_ratio=1.0, mlp_ratio=4.49),
    "D1": dict(_LINEAR_HEMISPHERES, merging="prod"),
    "D2": dict(_LINEAR_HEMISPHERES),
    "E1": dict(_LINEAR_HEMISPHERES, merging="prod", lateral_activation="left"),
    "E2": dict(_LINEAR_HEMISPHERES, lateral_activation="both"),
    "F1": dict(_LINEAR_HEMISPHERES, long_skip="first_stage"),
    "F2": dict(_LINEAR_HEMISPHERES, long_skip="second_stage"),
    "F2-deep": {},  # the defaults: the reference configs/lmlp_f2.py, depth 16, s = 4
}

# L-MLP Table 1 (a), row A2: MLP-Mixer at A1's size (23,484,738 parameters) on A1's skeleton: the COCO tokens
# (32×32×4 latents, patch 2, 77 CLIP tokens: L = 334), D = 512, depth 12 (13 blocks) and, as every row before F1,
# no long skips. The Mixer's standard channel ratio 4 cannot be kept: its channel MLP alone (2.10M) outweighs a whole
# A1 block (1.76M), so the widths are matched to A1 instead. The token MLP is A1's FNN_L (L → 2L → L), and the channel
# MLP takes the 5·D² that A1 spends on FNN_R (D → 2D → D) and its merge projection (D × D): D_C = 2.5·D. A2 then
# differs from A1 only in how the block is wired, and has 23,486,038 parameters (+0.006 %).
TABLE_1_A2 = dict(num_layers=12, long_skips=False, token_mlp_ratio=2.0, mlp_ratio=2.5)

# L-MLP Table 1 (a), row A3: gMLP at A1's size (23,484,738 parameters) on A1's skeleton: the COCO tokens (32×32×4
# latents, patch 2, 77 CLIP tokens: L = 334), D = 512, depth 12 (13 blocks) and, as every row before F1, no long
# skips. d_ffn is gMLP's one width (the spatial projection is L × L whatever the config), so it is what we size: the
# gMLP paper's d_ffn = 6·D would make 32.8M parameters, and d_ffn = 2140 (mlp_ratio 4.18) matches A1's blocks
# (1,761,226 parameters each against 1,761,686), for 23,478,758 parameters in all (-0.025 %).
TABLE_1_A3 = dict(num_layers=12, long_skips=False, mlp_ratio=4.18)

# The COCO skeleton (32×32×4 latents, patch 2, D = 512, 77 text tokens, L = 334) at depth 16 (8 + 1 + 8 blocks, the
# F2-deep depth) gives each family 44,955,812 parameters, 1.3% above the 44,366,248 of the L-MLP's Table 1 F2.
# ParaMixer and AsymMixer keep the paper's widths (0.5·D, 4·D); SymMixer, with half the MLP parameters, doubles both
# widths, as the paper's parameter-matched "Sym (dw)" (Table 3b), which doubles its MACs.
_DEPTH_16 = dict(num_layers=16)

# By family name (`diffusers_lmlp.models.FAMILIES`): configuration name -> `__init__` overrides of that family's model.
NAMED_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "lmlp": TABLE_1 | {"shapes-S": SHAPES_SMALL, "emoji-S": EMOJI_SMALL},  # and the embedded worlds' models
    # Table 2 of the MoE-MLP paper: F2's skeleton with E experts and H heads per block.
    "moe_mlp": {
        "2E1H": {"num_experts": 2, "num_heads": 1},
        "4E1H": {"num_experts": 4, "num_heads": 1},
        "4E2H": {"num_experts": 4, "num_heads": 2},
        "shapes-moe-S": dict(SHAPES_SMALL, num_experts=2, num_heads=2),
    },
    "uvit": {"U-ViT-S/2": {}, "U-ViT-S/2-deep": {"num_layers": 16}},
    "mlp_mixer": {"A2": TABLE_1_A2},
    "paramixer": {"ParaMixer-S": _DEPTH_16},
    "symmixer": {"SymMixer-S": dict(_DEPTH_16, token_mlp_ratio=1.0, mlp_ratio=8.0)},
    "asymmixer": {"AsymMixer-S": _DEPTH_16},
    "gmlp": {"A3": TABLE_1_A3},
}
