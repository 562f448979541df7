"""The demo Space's former home. The Space now lives in the repository's `spaces/lmlp-demo/` folder, which setup.py
ships in the wheel as `diffusers_lmlp/space/lmlp_demo/` (see `diffusers_lmlp.hub.space.DEFAULT_SPACE_DIR`); the
module `app` here only keeps `python -m diffusers_lmlp.space.app` working, deprecated, for one release."""
