"""The trainer's command, in the shape of diffusers' example scripts: `parse_args` (`training.arguments`, before any
heavy import), then `main` (`training.trainer`). `accelerate launch -m diffusers_lmlp.train [options]`."""

import os

from diffusers_lmlp.training.arguments import build_parser, parse_args  # noqa: F401  (the diffusers example's names)


def main(argv: list[str] | None = None, exit_when_done: bool = False) -> None:
    """Parse `argv` (default `sys.argv[1:]`; a wrong option exits before any heavy import), then train;
    `exit_when_done` ends the process once the run is saved everywhere."""
    args = parse_args(argv)
    from diffusers_lmlp.training.trainer import train

    train(args, exit_when_done)


def cli() -> None:
    """The command line. A multi-process run's processes end right after saving, skipping the interpreter's teardown,
    which can hang after a complete run (pytorch/pytorch#190489)."""
    main(exit_when_done=int(os.environ.get("WORLD_SIZE", "1")) > 1)


if __name__ == "__main__":
    cli()
