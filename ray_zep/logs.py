"""Logging setup: the rank on every line; rank 0 (and the driver) at INFO, others quieter."""

from __future__ import annotations

import logging
import os

from ray_zep.constants import LOG_LEVEL_ENV_VAR

LOGGERS = ("ray_zep", "workers")


def setup_logging(rank: int | None = None, role: str = "driver") -> None:
    """Configure the ray_zep and workers loggers for this process.

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
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s [{who}] %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
        )
    )
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False
