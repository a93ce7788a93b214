"""Waiting on asynchronous work handles within a timeout."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

from ray_zep.errors import CommError

BACKEND_FAILURE_WORDS = ("gloo", "nccl", "timed out", "connection closed", "connection reset")
"""What the backends' own errors say when a peer is lost or a collective times out."""


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
        raise _comm_error(exc, what, timeout_s, rank) from None


@contextlib.contextmanager
def collectives_of(what: str, timeout_s: float, rank: int) -> Iterator[None]:
    """Turn a backend's error raised by collectives we do not wait on ourselves (FSDP2's,
    torch's own) into the CommError `wait_all` raises; other errors pass unchanged."""
    try:
        yield
    except RuntimeError as exc:
        if not any(word in str(exc).lower() for word in BACKEND_FAILURE_WORDS):
            raise
        raise _comm_error(exc, what, timeout_s, rank) from None


def _comm_error(exc: RuntimeError, what: str, timeout_s: float, rank: int) -> CommError:
    """The backend's error as one line naming `what`, the rank and the limit's key."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return CommError(
        f"{what} on rank {rank} failed or exceeded comm.timeout_s={timeout_s:g}: {first}"
    )
