"""Deprecated: `python -m diffusers_lmlp.space.app` runs the demo Space's app, which moved to `spaces/lmlp-demo/`.

Run the Space's own `app.py` instead: `cd spaces/lmlp-demo && python app.py` in a checkout, or
`python <DEFAULT_SPACE_DIR>/app.py` with an installed wheel (`diffusers_lmlp.hub.space.DEFAULT_SPACE_DIR`, printed by
the warning). This module goes away in diffusers-lmlp 0.2.0.
"""

import runpy

from ..deprecation import deprecate
from ..hub.space import DEFAULT_SPACE_DIR


REMOVED_IN = "0.2.0"


def main() -> None:
    """Warn that this command is deprecated, then run the Space's `app.py` as its own script."""
    app = DEFAULT_SPACE_DIR / "app.py"
    deprecate(
        "`python -m diffusers_lmlp.space.app`",
        REMOVED_IN,
        f"The Space moved to spaces/lmlp-demo/: run its app with `python {app}` (in a checkout: "
        "`cd spaces/lmlp-demo && python app.py`).",
    )
    runpy.run_path(str(app), run_name="__main__")


if __name__ == "__main__":
    main()
