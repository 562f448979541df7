"""The wheel's copy of the demo Space, `spaces/lmlp-demo/` as `lmlp_demo/` (`hub.space.DEFAULT_SPACE_DIR`)."""
