"""Logging setup: the rank on every line; rank 0 (and the driver) at INFO, others quieter."""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

from ray_zep.constants import LOG_LEVEL_ENV_VAR

LOGGERS = ("ray_zep", "ray_zep_workers")


class CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record is emitted.

    A plain StreamHandler keeps the stream it was built with; when that stream is swapped
    out and closed (a test runner's capture, a notebook cell, a caller that redirects
    stderr), every later record fails with "I/O operation on closed file".
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        """The stream is always the current `sys.stderr`; StreamHandler's own assignment is moot."""


def setup_logging(rank: int | None = None, role: str = "driver") -> None:
    """Configure the ray_zep and ray_zep_workers loggers for this process.

    Idempotent: a second call replaces the handler an earlier call installed and leaves
    every other handler (a user's file handler, a test runner's capture) where it is.

    Args:
        rank: the process's rank, or None for a process that is not a rank.
        role: name shown for a process that is not a rank (driver, data, ...).
    """
    level_name = os.environ.get(LOG_LEVEL_ENV_VAR, "INFO").upper()
    level = logging.getLevelName(level_name)
    if not isinstance(level, int):
        level = logging.INFO
    if rank not in (None, 0):
        level = max(level, logging.WARNING)
    who = role if rank is None else f"rank {rank}"
    handler = CurrentStderrHandler()
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s [{who}] %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
        )
    )
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, CurrentStderrHandler)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
