"""The named configurations of every block family: data only, so command lines list them without importing a model."""

from typing import Any


# The embedded worlds' models: shapes (`shapes-S`, `shapes-moe-S`), emoji (`emoji-S`, on the emoji CLIP's 25 tokens).
SHAPES_SMALL = dict(
    sample_size=8, patch_size=2, in_channels=8, hidden_size=96, num_layers=8, text_embed_dim=64, text_seq_len=10
)
EMOJI_SMALL = dict(
    sample_size=8, patch_size=2, in_channels=8, hidden_size=192, num_layers=12, text_embed_dim=128, text_seq_len=25
)

# L-MLP Table 1 (§5.2), the design ablation on the COCO skeleton, each group at a matched size by one width: the
# hemispheres' MLP width without a second stage, else the joint MLP's s (§4.1). Readings where the paper is silent:
# - "1-layer MLP" hemispheres (A1, B1–B3, C1) are Linear → GELU → Linear; nothing before F1 has long skips (Table 1 f).
# - F2-deep, the reference code, adds the skip to the residual stream ("Second Stage"); F1 to the hemispheres only.
# - B2's GLU gates the left hemisphere by the sigmoid of the right; E1's product gates the right by GELU(left).
# - A1 appears at 23.5M (group a) and at 45M (group c): "A1" and "A1-45M".
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

# Table 1 (a)'s baselines on A1's skeleton, widths matched to A1. A2, MLP-Mixer: the token MLP is A1's FNN_L
# (L → 2L → L), the channel MLP takes A1's FNN_R and merge budget (D_C = 2.5·D). A3, gMLP: d_ffn sized to A1's blocks.
TABLE_1_A2 = dict(num_layers=12, long_skips=False, token_mlp_ratio=2.0, mlp_ratio=2.5)
TABLE_1_A3 = dict(num_layers=12, long_skips=False, mlp_ratio=4.18)

# The ParaMixer families at the F2-deep depth 16; SymMixer doubles both widths, as the paper's "Sym (dw)" (Table 3b).
_DEPTH_16 = dict(num_layers=16)

# By family name (`diffusers_lmlp.models.FAMILIES`): configuration name -> `__init__` overrides of that family's model.
NAMED_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "lmlp": TABLE_1 | {"shapes-S": SHAPES_SMALL, "emoji-S": EMOJI_SMALL},
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
