"""The trainer's command, in the shape of diffusers' example scripts: `parse_args`, then `main`.

    accelerate launch -m diffusers_lmlp.train [options]   # or diffusers-lmlp-train, or examples/train_text_to_image.py

`--help` describes the trainer (`training.arguments.DESCRIPTION`). The options are parsed by `training.arguments`
and checked by `training.argument_checks` before anything heavy is imported; the run itself is `training.trainer`,
whose parts (components, batches, the step, checkpoints, validation, the end of the run) have modules of their own in
`diffusers_lmlp.training`.
"""

import os

from diffusers_lmlp.training.arguments import build_parser, parse_args  # noqa: F401  (the diffusers example's names)


def main(argv: list[str] | None = None, exit_when_done: bool = False) -> None:
    """Parse the options (a wrong one exits (2) before any heavy import), then train.

    Args:
        argv (`list[str]`, *optional*): The arguments; `sys.argv[1:]` when None.
        exit_when_done (`bool`, *optional*, defaults to `False`): End the process as soon as the run is saved and
            every process has finished (see `diffusers_lmlp.training.trainer.train`).
    """
    args = parse_args(argv)
    from diffusers_lmlp.training.trainer import train

    train(args, exit_when_done)


def cli() -> None:
    """The command line: `python -m diffusers_lmlp.train`, `diffusers-lmlp-train`, examples/train_text_to_image.py.

    Each process of a multi-process run ends as soon as the run is saved and the processes have left together, without
    tearing down its objects and interpreter, which can hang after a complete run (pytorch/pytorch#190489).
    """
    main(exit_when_done=int(os.environ.get("WORLD_SIZE", "1")) > 1)


if __name__ == "__main__":
    cli()
