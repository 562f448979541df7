"""Where the wheel keeps the demo Space: setup.py ships the repository's `spaces/lmlp-demo/` folder as
`diffusers_lmlp/space/lmlp_demo/` (`diffusers_lmlp.hub.space.DEFAULT_SPACE_DIR`)."""
