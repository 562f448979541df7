#!/usr/bin/env python
"""Train an L-MLP or MoE-MLP text-to-image backbone: the trainer `diffusers_lmlp.train`, run from a checkout.

    accelerate launch --config_file examples/accelerate.yaml examples/train_text_to_image.py [--help for options]

The same trainer is `accelerate launch -m diffusers_lmlp.train` (or `diffusers-lmlp-train`) for a pip install.
"""

from diffusers_lmlp.train import cli


if __name__ == "__main__":
    cli()
