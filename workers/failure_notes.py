"""One line per worker failure, in the driver's log, in place of Ray Train's tracebacks.

Ray Train's workers log the traceback of every error that ends their training function,
and its controller logs each failure it handles with all of them again. The driver
keeps Ray Train's console quiet (`ray_train_console_level`; its log files under the Ray
session's `logs/train/` still hold everything) and this callback, which runs in the
controller, sends the driver each failure's first line per rank. The driver logs it,
then the restart that follows ("workers restarted from the checkpoint of step k"); an
error that ends the run reaches the driver whole.
"""

from __future__ import annotations

import os
from typing import Any

from ray.train import UserCallback

from ray_zep.constants import LOG_LEVEL_ENV_VAR
from ray_zep.errors import find_zep_error, first_line

FAILURE_EVENT = "worker_failure"
"""`{"event", "errors": {rank: "Type: first line"}}`: workers raised, Ray Train decides."""


def ray_train_console_level() -> str:
    """Ray Train's console log level: CRITICAL (nothing it logs is), INFO with
    RAY_ZEP_LOG_LEVEL=DEBUG."""
    debug = os.environ.get(LOG_LEVEL_ENV_VAR, "").upper() == "DEBUG"
    return "INFO" if debug else "CRITICAL"


def describe(exc: BaseException) -> str:
    """`Type: first line of the message` of the error at the root of `exc` (Ray Train
    hands a worker's error over wrapped with its traceback as the message)."""
    exc = getattr(exc, "_base_exc", exc)
    root = find_zep_error(exc) or getattr(exc, "cause", None) or exc
    return f"{type(root).__name__}: {first_line(root)}"


class FailureNotes(UserCallback):
    """Sends each worker failure to the driver's event queue (never blocks the controller).

    Args:
        events: the driver's `ray.util.queue.Queue`.
    """

    def __init__(self, events: Any) -> None:
        self.events = events

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        errors = {rank: describe(exc) for rank, exc in sorted(worker_exceptions.items())}
        self.events.actor.put_nowait.remote({"event": FAILURE_EVENT, "errors": errors})
