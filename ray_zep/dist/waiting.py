"""Waiting on asynchronous work handles within a timeout."""

from __future__ import annotations

import datetime

from ray_zep.errors import CommError


def wait_all(works: list, what: str, timeout_s: float, rank: int) -> None:
    """Wait on every work handle within `timeout_s` seconds each.

    Raises:
        CommError: a handle failed (a lost peer) or timed out; names `what`
            and the config key that sets the limit.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        for work in works:
            work.wait(timeout=timeout)
    except RuntimeError as exc:
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise CommError(
            f"{what} on rank {rank} failed or exceeded comm.timeout_s={timeout_s:g}: {first}"
        ) from None
