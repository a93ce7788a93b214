"""Capacity bookkeeping shared by the planners."""

from __future__ import annotations

import numpy as np

from ray_zep.errors import PlacementError


def water_fill(total: int, free: np.ndarray) -> np.ndarray:
    """Spread `total` tokens over bins as evenly as their free space allows.

    Bins with less room than the even share are filled up; the rest split what
    remains within one token of each other, the extra tokens going to the bins
    with the most room (so repeated calls on shrinking free space stay balanced).

    Args:
        total: tokens to place.
        free: free tokens of each bin (int, >= 0).

    Returns:
        int64 tokens per bin, each <= free, summing to `total`.

    Raises:
        PlacementError: the bins hold fewer than `total` free tokens.
    """
    free = np.asarray(free, dtype=np.int64)
    if total > int(free.sum()):
        raise PlacementError(f"{total} tokens do not fit in {int(free.sum())} free tokens")
    shares = np.zeros(len(free), dtype=np.int64)
    remaining = int(total)
    order = np.argsort(free, kind="stable")
    for done, index in enumerate(order):
        # Floor shares first: a bin never takes more than the bins after it
        # (which have at least as much room), so the last bin always fits the rest.
        take = min(int(free[index]), remaining // (len(free) - done))
        shares[index] = take
        remaining -= take
    return shares


def check_total(lengths: np.ndarray, world: int, tokens_per_rank: int, planner: str) -> None:
    """Refuse a batch larger than the ranks can hold."""
    total = int(lengths.sum())
    if total > world * tokens_per_rank:
        raise PlacementError(
            f"{planner}: the batch has {total} tokens but {world} ranks x "
            f"train.tokens_per_rank={tokens_per_rank} hold {world * tokens_per_rank}"
        )
    if lengths.size and int(lengths.min()) < 1:
        raise PlacementError(f"{planner}: sequence lengths must be >= 1")
