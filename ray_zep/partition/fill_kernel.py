"""The whole-sequence fill's dealing (`ray_zep.partition.level_fill.fill_whole`), compiled
(`ray_zep.partition.compiled`): sequences in order, each to the fullest rank with room under
the level (`index_kernel`), else, while they may still become small rings, to a small ring
(`ring_search_kernel`), else to the least loaded rank; it gives up once a rank reaches its
bound or the rest is `hopeless`. A small ring it places itself, on the rank arrays and the
ring labels, and records (the fill writes the placement's groups from the records); a
sequence that spills it hands back (the fill places those). Answers equal the array code
it replaced, bit for bit.
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition import index_kernel as index_ops
from ray_zep.partition.compiled import compiled
from ray_zep.partition.ring_search_kernel import FREE, SEVERAL, co_member_ring, spare_ring
from ray_zep.partition.sum_kernel import pairwise_sum

DONE, GIVEN_UP, SPILL = range(3)
"""What `deal` stopped at: every sequence dealt; a rank reached the bound or the rest is
hopeless; a spill."""
POSITION, RINGS_OPEN, HOPELESS, RECORDED, NEXT_LABEL = range(5)
"""Where `deal`'s `state` keeps the next sequence, whether sequences may still become
small rings, whether it gave up on a `hopeless` check, how many small rings it recorded
and the next new ring label."""
SECOND, KEPT = 1, 2
"""Flags of a recorded ring (`deal`'s `rings`): a second ring on members of one ring; a
ring whose members keep their peers' K/V in token room they leave free."""
RING_HEAD = 3
"""A recorded ring's row: its sequence's position, its flags and its size's index into the
sequence's small rings, then its ranks."""
HUGE = np.iinfo(np.int64).max // 2
"""`reserved` where no token room frees any: more than any rank holds."""


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
    sizes_of: np.ndarray,
    rings: np.ndarray,
    kept_kv: np.ndarray,
) -> int:
    """Deals sequences (`sizes` tokens, `works` seconds, `small` their small rings'
    member work at 2 .. G ranks, in dealing order) from `state`'s position, each whole to
    a rank (`local`), or as a small ring (`_place_ring`: recorded in `rings`, labelled in
    `labels`, whose `sizes_of` are the ranks of each label's group), writing `load`,
    `tokens` and `in_ring`. Returns what it stopped at; `state` then names the sequence
    it stopped at.

    `rises_above`: the level and a little more (a second ring, where `second_rings`, is
    sought only where the rank taking the sequence whole would end above it and the
    busiest rank so far);
    `check`: `hopeless_check`'s arrays (every `CHECK_EVERY`-th sequence, none where
    `check[0]` is empty);
    `kept_kv`: what `reserved` reads of the work model."""
    count = sizes.size
    for position in range(state[POSITION], count):
        state[POSITION] = position
        n, w = sizes[position], works[position]
        if hopeless(check, position, load, tokens, capacity, prune_above):
            state[HOPELESS] = 1
            return GIVEN_UP
        index_ops.set_bound(index, capacity - n, load, tokens)
        if w < smallest_ring:
            state[RINGS_OPEN] = 0
        if not state[RINGS_OPEN]:  # best fit, else the least loaded: one search
            then = capacity - sizes[position + 1] if position + 1 < count else -1
            rank = index_ops.take(index, level - w, w, n, then, load, tokens)
            if rank >= 0:
                local[position] = rank
                if load[rank] >= prune_above:
                    return GIVEN_UP
                continue
        rank = index_ops.fullest_under(index, level - w)
        if rank < 0:
            rank = index_ops.least_loaded(index)
            if state[RINGS_OPEN] and gpus > 1:
                ranks, k = spare_ring(in_ring, tokens, load, n, small[position], level, capacity,
                                      gpus)  # fmt: skip
                second = False
                # a second ring only where the rank taking it whole would end busiest,
                # and more than a little over the level
                if (
                    k < 0
                    and second_rings
                    and (rank < 0 or load[rank] + w > max(load.max(), rises_above))
                ):
                    ranks, k = co_member_ring(labels, tokens, load, n, small[position], level,
                                              capacity, gpus)  # fmt: skip
                    second = True
                if k >= 0:
                    _place_ring(state, position, ranks, k, second, n, small[position, k], load,
                                tokens, in_ring, labels, sizes_of, rings, kept_kv,
                                capacity)  # fmt: skip
                    for member in ranks:
                        if load[member] >= prune_above:
                            return GIVEN_UP
                    for member in ranks:
                        index_ops.move(index, member, load, tokens)
                    continue
        if rank < 0:
            return SPILL
        load[rank] += w
        if load[rank] >= prune_above:
            return GIVEN_UP
        tokens[rank] += n
        local[position] = rank
        index_ops.move(index, rank, load, tokens)
    state[POSITION] = count
    return DONE


@compiled
def _place_ring(state, position, ranks, k, second, n, member, load, tokens, in_ring, labels,
                sizes_of, rings, kept_kv, capacity) -> None:  # fmt: skip
    """The small ring of the sequence at `position` (`n` tokens) over `ranks`, of size
    index `k`, as `level_fill.shared_ring` and `kept_room` place one: each member takes
    `member` seconds and its equal share of the tokens (the first n mod d one more); a
    first ring's members also the room for their peers' K/V where the budget lacks it and
    their tokens allow it (`kept_room`), and join a ring (`in_ring`); its label as
    `RingLabels.added` makes it (`sizes_of`: each label's group's ranks). Recorded in
    `rings`, the next of `state`'s count."""
    d = k + 2
    chunk, extra = n // d, n % d
    for i in range(d):
        load[ranks[i]] += member
    reserve, flags = 0, SECOND if second else 0
    if not second:
        most = 0
        for i in range(d):
            most = max(most, tokens[ranks[i]] + chunk + (1 if i < extra else 0))
        reserve = reserved(n - chunk, kept_kv)
        if reserve == 0 or most + reserve > capacity:
            reserve = 0
        else:
            flags += KEPT
    for i in range(d):
        tokens[ranks[i]] += chunk + (1 if i < extra else 0) + reserve
        if not second:
            in_ring[ranks[i]] = True
    # a new label, where these ranks are not a group's already: its members in no ring take
    # it, the others are in several (a second ring's ranks share one label; they are that
    # label's group where they are as many)
    first = labels[ranks[0]]
    if not (second and first >= 0 and sizes_of[first] == d):
        label = state[NEXT_LABEL]
        sizes_of[label] = d
        state[NEXT_LABEL] += 1
        for i in range(d):
            labels[ranks[i]] = label if labels[ranks[i]] == FREE else SEVERAL
    row = state[RECORDED]
    rings[row, 0], rings[row, 1], rings[row, 2] = position, flags, k
    for i in range(d):
        rings[row, RING_HEAD + i] = ranks[i]
    state[RECORDED] += 1


@compiled
def reserved(kept: int, kept_kv: np.ndarray) -> int:
    """`WorkModel.reserved_tokens` of a ring of whole-GPU members keeping `kept` tokens of
    their peers (`kept_kv`: the K/V bytes of a token over every layer, the budget, the
    bytes of room each token frees)."""
    over = max(0.0, float(kept) * kept_kv[0] - kept_kv[1])
    if kept_kv[2] <= 0:
        return HUGE if over > 0 else 0
    return int(np.ceil(over / kept_kv[2]))


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
