"""Mixer blocks, one file per block family, each block `block(x (B, L, D), skip (B, L, D) | None) -> (B, L, D)`. Every
family but the UL-MLP (in `models/`) has its thin public model next to its block; the registry of
families is `diffusers_lmlp.models.families`."""
