"""Typed errors raised on bad input or failed distributed work.

Every message is one line that names the key, value or path to fix. The classes
are plain exceptions built from a single message argument, so they pickle through
Ray's object store and process boundaries unchanged.
"""

from __future__ import annotations

from typing import ClassVar


class ZepError(Exception):
    """Base class of every error ray_zep raises on purpose."""

    retryable: ClassVar[bool] = True
    """Whether starting the workers again may get past it (a lost peer, a timeout). Bad
    input is not: a wrong config, dataset or model file is as wrong on every retry, so a
    worker that meets one stops the run at once instead of restarting it."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigError(ZepError, ValueError):
    """A config key is unknown, has the wrong type, or holds a value out of range."""

    retryable = False


class TopologyError(ZepError, ValueError):
    """The topology is inconsistent, or does not match the processes that run it."""


class ClusterError(TopologyError):
    """The Ray cluster a run would join cannot be reached, or lacks the run's resources."""


class ProbeError(TopologyError):
    """The hardware probe could not read or make sense of the node's topology."""


class DataError(ZepError):
    """Base class of dataset problems."""

    retryable = False


class DatasetNotFoundError(DataError, FileNotFoundError):
    """`data.source` names a path that does not exist."""


class CorruptDatasetError(DataError):
    """A dataset file cannot be read, or does not have the expected schema."""


class EmptyDatasetError(DataError):
    """A dataset holds no tokens."""


class OverlongDocumentError(DataError):
    """A document is longer than the batch allows and `data.overlong=error`."""


class TokenOutOfVocabError(DataError):
    """A token id is negative or not below the model's vocabulary size."""


class MemoryPlanError(ConfigError):
    """The modelled per-rank memory of a run exceeds the GPU's memory."""


class PlacementError(ZepError):
    """A batch cannot be placed on the ranks under the chosen strategy."""

    retryable = False


class CommError(ZepError):
    """A collective failed or did not finish within its timeout."""


class CodecError(ZepError, ValueError):
    """A tensor cannot be compressed, or a compressed buffer is not valid."""


class CheckpointError(ZepError):
    """A checkpoint is missing, incomplete or does not match the run."""


def first_line(exc: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none): what a
    one-line report of someone else's error (a library's, Ray's) quotes."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def find_zep_error(exc: BaseException | None, _depth: int = 0) -> ZepError | None:
    """Find the ZepError at the root of an exception wrapped by Ray or torch.

    Ray wraps errors raised in tasks, actors and Train workers into its own
    exception types; the original sits in `.cause`, `__cause__`, per-worker failure
    maps or `args`. Walk those links (bounded depth) and return the first ZepError.

    Args:
        exc: the exception caught by the caller.

    Returns:
        The ZepError found, or None when the failure is not one of ours.
    """
    if exc is None or _depth > 8:
        return None
    if isinstance(exc, ZepError):
        cause = getattr(exc, "cause", None)  # Ray's copy of it carries the remote traceback
        return cause if isinstance(cause, ZepError) else exc
    linked: list[object] = [getattr(exc, "cause", None), exc.__cause__, exc.__context__]
    for attr in ("worker_failures", "errors"):
        failures = getattr(exc, attr, None)
        if isinstance(failures, dict):
            linked.extend(failures.values())
        elif isinstance(failures, (list, tuple)):
            linked.extend(failures)
    linked.extend(getattr(exc, "args", ()))
    for item in linked:
        if isinstance(item, BaseException):
            found = find_zep_error(item, _depth + 1)
            if found is not None:
                return found
    return None
