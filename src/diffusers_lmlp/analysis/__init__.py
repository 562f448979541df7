"""Look inside a model: the L-MLP paper's Fig. 6 lateralization maps, MoE-MLP routing and U-ViT attention, with the
numbers that check the papers' claims; `python -m diffusers_lmlp.analysis` (or `diffusers-lmlp-analysis`)."""
