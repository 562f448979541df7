"""Casting a model without diffusers' vacuous warning: `ModelMixin.to(dtype)` warns "There are modules in <Model>
that should be kept in float32: []" on every cast. A warning that names modules still passes.
"""

# `std_logging`: `hub push --with-code` puts the package's modules in one namespace, where `logging` is diffusers'.
import logging as std_logging
from collections.abc import Iterator
from contextlib import contextmanager


MODELS_LOGGER = "diffusers.models.modeling_utils"


class EmptyFp32ModulesWarning(std_logging.Filter):
    """Drops the warning that a model has modules to keep in float32 when it names none."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return "should be kept in float32: []." not in record.getMessage()


@contextmanager
def no_empty_fp32_warning() -> Iterator[None]:
    """Within the block, `EmptyFp32ModulesWarning` filters `MODELS_LOGGER`."""
    logger, empty_warning = std_logging.getLogger(MODELS_LOGGER), EmptyFp32ModulesWarning()
    logger.addFilter(empty_warning)
    try:
        yield
    finally:
        logger.removeFilter(empty_warning)
