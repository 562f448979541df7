"""Look inside a model: the L-MLP paper's Fig. 6 lateralization maps, MoE-MLP routing and U-ViT attention, with the
numbers that check the papers' claims; `python -m diffusers_lmlp.analysis` (or `diffusers-lmlp-analysis`).

| module | what it holds |
|---|---|
| `regions` | the token regions of a config: time, text, image patches on a g × g grid |
| `layers` | layer numbers as the reference figure script counts them, and the paper's default layers |
| `kinds` | what each subcommand reads in a model, and the error that names the subcommand that fits |
| `sources` | what `--pipeline` names: the shipped shapes pipeline, a folder, a Hub id |
| `metrics` | diagonal ratio, locality, periodicity, load balance (torch only) |
| `lateralization` | the `lateralization` subcommand: first-stage weights, measures, files |
| `sampling`, `attention`, `routing` | `routing`: the sampling it watches, U-ViT attention maps, MoE-MLP usage |
| `figures`, `tables` | drawing (Pillow) and the printed tables |
"""
