"""The whole-sequence fill's dealing (`ray_zep.partition.level_fill.fill_whole`), compiled
(`ray_zep.partition.compiled`): sequences in order, each to the fullest rank with room under
the level (`index_kernel`), else, while they may still become small rings, to a small ring
(`ring_search_kernel`), else to the least loaded rank; it gives up once a rank reaches its
bound or the rest is `hopeless`, and hands back each sequence that takes a small ring or
spills (the fill places those). Answers equal the array code it replaced, bit for bit.
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition import index_kernel as index_ops
from ray_zep.partition.compiled import compiled
from ray_zep.partition.ring_search_kernel import co_member_ring, spare_ring
from ray_zep.partition.sum_kernel import pairwise_sum

DONE, GIVEN_UP, RING, SECOND_RING, SPILL = range(5)
"""What `deal` stopped at: every sequence dealt; a rank reached the bound or the rest is
hopeless; a small ring on ranks in no ring, or on members of one ring; a spill."""
_POSITION, _RINGS_OPEN, _HOPELESS = range(3)
"""Where `deal`'s `state` keeps the next sequence, whether sequences may still become
small rings, and whether it gave up on a `hopeless` check."""


@compiled
def deal(
    state: np.ndarray,
    sizes: np.ndarray,
    works: np.ndarray,
    small: np.ndarray,
    load: np.ndarray,
    tokens: np.ndarray,
    in_ring: np.ndarray,
    labels: np.ndarray,
    index: tuple,
    local: np.ndarray,
    level: float,
    capacity: int,
    prune_above: float,
    smallest_ring: float,
    rises_above: float,
    second_rings: bool,
    gpus: int,
    check: tuple,
) -> tuple[int, np.ndarray, int]:
    """Deals sequences (`sizes` tokens, `works` seconds, `small` their small rings'
    member work at 2 .. G ranks, in dealing order) from `state`'s position, each whole to
    a rank (`local`), writing `load` and `tokens`. Returns (what it stopped at, the small
    ring's ranks, its size's index into the sequence's row of `small`); `state` then
    names the sequence it stopped at.

    `rises_above`: the level and a little more (a second ring, where `second_rings`, is
    sought only where the rank taking the sequence whole would end above it and the
    busiest rank so far);
    `check`: `hopeless_check`'s arrays (every `CHECK_EVERY`-th sequence, none where
    `check[0]` is empty)."""
    none = np.zeros(0, dtype=np.int64)
    count = sizes.size
    for position in range(state[_POSITION], count):
        state[_POSITION] = position
        n, w = sizes[position], works[position]
        if hopeless(check, position, load, tokens, capacity, prune_above):
            state[_HOPELESS] = 1
            return GIVEN_UP, none, -1
        index_ops.set_bound(index, capacity - n, load, tokens)
        if w < smallest_ring:
            state[_RINGS_OPEN] = 0
        if not state[_RINGS_OPEN]:  # best fit, else the least loaded: one search
            then = capacity - sizes[position + 1] if position + 1 < count else -1
            rank = index_ops.take(index, level - w, w, n, then, load, tokens)
            if rank >= 0:
                local[position] = rank
                if load[rank] >= prune_above:
                    return GIVEN_UP, none, -1
                continue
        rank = index_ops.fullest_under(index, level - w)
        if rank < 0:
            rank = index_ops.least_loaded(index)
            if state[_RINGS_OPEN] and gpus > 1:
                ranks, k = spare_ring(in_ring, tokens, load, n, small[position], level, capacity,
                                      gpus)  # fmt: skip
                if k >= 0:
                    return RING, ranks, k
                # a second ring only where the rank taking it whole would end busiest,
                # and more than a little over the level
                if second_rings and (rank < 0 or load[rank] + w > max(load.max(), rises_above)):
                    ranks, k = co_member_ring(labels, tokens, load, n, small[position], level,
                                              capacity, gpus)  # fmt: skip
                    if k >= 0:
                        return SECOND_RING, ranks, k
        if rank < 0:
            return SPILL, none, -1
        load[rank] += w
        if load[rank] >= prune_above:
            return GIVEN_UP, none, -1
        tokens[rank] += n
        local[position] = rank
        index_ops.move(index, rank, load, tokens)
    state[_POSITION] = count
    return DONE, none, -1


@compiled
def hopeless(check, position, load, tokens, capacity, prune_above) -> bool:
    """Whether the sequences the fill has yet to deal must bring some rank to the bound:
    each adds at least the least seconds per token among them (a ring or spill of one
    spreads at least its whole work over its tokens) to ranks within their free tokens,
    so where the tokens the ranks can take before reaching it are fewer than the rest,
    the placement would be abandoned anyway: it is now. Checked every `check[3]`-th
    sequence; sums as numpy sums arrays (pairwise), so that it answers as it did."""
    rest, work, density, every, limit = check
    if rest.size == 0 or position % every:
        return False
    least = density[position]
    if least <= 0:
        return False
    world = load.size
    under = np.empty(world)
    room = np.empty(world)
    free_under = np.empty(world)
    with_room = 0
    for rank in range(world):
        free = max(0, capacity - tokens[rank])
        under[rank] = max(0.0, limit - load[rank])
        room[rank] = min(float(free), under[rank] / least)
        if free > 0:
            free_under[with_room] = under[rank]
            with_room += 1
    if pairwise_sum(free_under, 0, with_room) < work[position]:
        return True  # the ranks with free tokens lack the seconds for the rest
    return pairwise_sum(room, 0, world) < rest[position]
