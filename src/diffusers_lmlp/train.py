"""The trainer's command, in the shape of diffusers' example scripts: `parse_args`, then `main`.

    accelerate launch -m diffusers_lmlp.train [options]   # or diffusers-lmlp-train, or examples/train_text_to_image.py

The options are parsed and checked (`training.arguments`) before any heavy import; the run itself is
`training.trainer`.
"""

import os

from diffusers_lmlp.training.arguments import build_parser, parse_args  # noqa: F401  (the diffusers example's names)


def main(argv: list[str] | None = None, exit_when_done: bool = False) -> None:
    """Parse the options (a wrong one exits before any heavy import), then train.

    Args:
        argv (`list[str]`, *optional*): The arguments; `sys.argv[1:]` when None.
        exit_when_done (`bool`, *optional*, defaults to `False`): End the process once the run is saved everywhere.
    """
    args = parse_args(argv)
    from diffusers_lmlp.training.trainer import train

    train(args, exit_when_done)


def cli() -> None:
    """The command line. A multi-process run's processes end right after saving, skipping the interpreter's teardown,
    which can hang after a complete run (pytorch/pytorch#190489)."""
    main(exit_when_done=int(os.environ.get("WORLD_SIZE", "1")) > 1)


if __name__ == "__main__":
    cli()
