"""The trainer's command, in the shape of diffusers' example scripts: `parse_args`, then `main`.

    accelerate launch -m diffusers_lmlp.train [options]   # or diffusers-lmlp-train, or examples/train_text_to_image.py

`--help` describes the trainer (`training.arguments.DESCRIPTION`). The options are parsed and checked by
`training.arguments` before anything heavy is imported; the run itself (components, batches, the loop, validation
and the finished pipeline) is `training.trainer`.
"""

import os

from diffusers_lmlp.deprecation import deprecate
from diffusers_lmlp.training.arguments import build_parser, parse_args  # noqa: F401  (the diffusers example's names)


# The trainer's functions lived in this module until the trainer moved into `diffusers_lmlp.training`; their old
# path keeps working, with a warning, until this version.
MOVED_REMOVED_IN = "0.2.0"
MOVED_TO = ("diffusers_lmlp.training.arguments", "diffusers_lmlp.training.trainer")


def main(argv: list[str] | None = None) -> None:
    """Parse the options (a wrong one exits (2) before any heavy import), then train.

    Args:
        argv (`list[str]`, *optional*): The arguments; `sys.argv[1:]` when None.
    """
    args = parse_args(argv)
    from diffusers_lmlp.training.trainer import train

    train(args)


def cli() -> None:
    """The command line: `python -m diffusers_lmlp.train`, `diffusers-lmlp-train`, examples/train_text_to_image.py."""
    main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from diffusers_lmlp.training.trainer import leave_finished_process

        leave_finished_process()


def __getattr__(name: str):
    """The trainer's names at their former path, with a deprecation warning."""
    if name.startswith("_"):  # Python's own lookups (`__path__`, ...) import nothing
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    for module_name in MOVED_TO:
        module = importlib.import_module(module_name)
        if hasattr(module, name):
            deprecate(
                f"`diffusers_lmlp.train.{name}`", MOVED_REMOVED_IN, f"Import it from `{module_name}`.", stacklevel=3
            )
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    cli()
