"""Capacity bookkeeping shared by the planners."""

from __future__ import annotations

import heapq

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
    if len(free) > FILL_LOOP_BINS:
        return water_fill_rows(np.asarray([total]), free[None, :])[0]
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


FILL_LOOP_BINS = 32
"""Bins up to which `water_fill` walks them one by one (numpy's calls cost more on a
node's few ranks); past it, `water_fill_rows` gives the same shares on arrays."""


def water_fill_rows(totals: np.ndarray, free: np.ndarray) -> np.ndarray:
    """`water_fill` of each row of `free` (rows x bins) with its entry of `totals`, all
    rows at once: the same shares as walking each row's bins by room, each taking the
    smaller of its room and the remaining tokens over the bins left. While every bin
    before has been filled, what remains is the total less their room; the first bin whose
    room exceeds its share ends that run. Every later bin has at least that much room, so
    none is capped again: the R tokens left go as R // m to each of the m bins left, and
    one more to each of the last R mod m (each share floors what remains).

    Raises:
        PlacementError: a row holds fewer than its total free tokens.
    """
    free = np.asarray(free, dtype=np.int64)
    totals = np.asarray(totals, dtype=np.int64)
    room_left = free.sum(axis=1)
    short = np.flatnonzero(totals > room_left)
    if short.size:
        row = int(short[0])
        raise PlacementError(f"{int(totals[row])} tokens do not fit in {int(room_left[row])} "
                             "free tokens")  # fmt: skip
    order = np.argsort(free, axis=1, kind="stable")
    room = np.take_along_axis(free, order, axis=1)
    rows, count = room.shape
    filled = np.cumsum(room, axis=1)
    before = filled - room
    capped = room > (totals[:, None] - before) // (count - np.arange(count))
    first = np.where(capped.any(axis=1), capped.argmax(axis=1), count)
    before_first = np.concatenate([before, filled[:, -1:]], axis=1)[np.arange(rows), first]
    left, bins_left = totals - before_first, count - first
    each, extra = np.divmod(left, np.maximum(bins_left, 1))
    column = np.arange(count)
    shared = column >= first[:, None]
    sorted_shares = np.where(shared, each[:, None], room)
    sorted_shares += shared & (column >= count - extra[:, None])
    shares = np.empty_like(sorted_shares)
    np.put_along_axis(shares, order, sorted_shares, axis=1)
    return shares


def place_whole(
    sizes: list[int], bins: int, capacity: int, work: list[float], by_work: bool = True
) -> tuple[list[int], np.ndarray, np.ndarray] | None:
    """Bin of each whole sequence, in the order given, or None when one fits nowhere.

    Each goes to the bin with the least summed `work` (one figure per sequence), or
    unless `by_work` to the bin with the most free tokens, lowest index on ties, among
    those with room. Two heaps keep this O(log bins) per sequence (batches hold tens of
    thousands): `ready` holds bins keyed for the choice, `short` the bins found too
    full, by most free tokens first. A bin leaves `ready` when it lacks room for the
    sequence at hand and comes back once a shorter one fits it, so full bins are not
    searched again and again.

    Returns:
        The bins, then every bin's free tokens and summed work after them.
    """
    free, load = [capacity] * bins, [0.0] * bins
    ready = [(0.0 if by_work else -capacity, b) for b in range(bins)]
    short: list[tuple[int, int]] = []
    placed = []
    for i, n in enumerate(sizes):
        while short and -short[0][0] >= n:
            b = heapq.heappop(short)[1]
            heapq.heappush(ready, (load[b] if by_work else -free[b], b))
        while ready and free[ready[0][1]] < n:
            b = heapq.heappop(ready)[1]
            heapq.heappush(short, (-free[b], b))
        if not ready:
            return None
        b = ready[0][1]
        free[b] -= n
        load[b] += work[i]
        heapq.heapreplace(ready, (load[b] if by_work else -free[b], b))
        placed.append(b)
    return placed, np.asarray(free, dtype=np.int64), np.asarray(load)


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
