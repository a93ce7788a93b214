"""Session-wide test plumbing."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from ray_zep.logs import LOGGERS
from tests.helpers.procs import close_pools


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Ray tests start clusters of their own: give the idle gloo pools' memory back first."""
    if item.get_closest_marker("ray") is not None:
        close_pools()


_PROJECT_LOGGERS = [logging.getLogger(name) for name in LOGGERS]
_LOGGERS_AT_START = [(lg.handlers[:], lg.level, lg.propagate) for lg in _PROJECT_LOGGERS]


@pytest.fixture(autouse=True)
def _restore_project_loggers() -> Iterator[None]:
    """A command run in-process configures the project's loggers (`setup_logging`); every test
    ends with them as the session began, so no test sees another's handlers, levels or
    propagation (pytest attaches its capture to loggers that do not propagate)."""
    yield
    for logger, (handlers, level, propagate) in zip(
        _PROJECT_LOGGERS, _LOGGERS_AT_START, strict=True
    ):
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate
