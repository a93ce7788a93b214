"""Split sequences that share one intra-node ring (`ray_zep.partition.balance`).

A rank joins at most one ring (but for `hosting`'s), so a ring of d members over a
sequence whose work is 1.1 ranks' worth of the level leaves 0.9 of a rank idle per ring
(short sequences over L tokens need a ring of two, whatever their work). Several
sequences on the same ranks form one ring (one queue item: every step forwards all their
chunks together, `AttentionPlan.items`), so the planner packs them: sequences whose rings
fit in a node, most work first, each joins the group it costs the fewest extra ranks
(the group may grow up to a node's GPUs) when that is fewer than its own ring
needs, its members' work and tokens within the level and L. A group's member work
is the sum of its sequences' alone (a ring's transfers and compute overlap apart
for each sequence: an upper bound of the shared ring's).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

WINDOW = 96
"""Groups a sequence may join: the latest opened that still have room (the earlier
ones, opened for longer sequences, are the fullest)."""
SLOTS = np.arange(WINDOW)


@dataclass(frozen=True)
class RingGroup:
    """Sequences (indices into the split sequences) on one ring of `degree` ranks."""

    members: tuple[int, ...]
    degree: int
    member_seconds: float


def group_rings(
    grid: np.ndarray,
    lengths: np.ndarray,
    degrees: np.ndarray,
    member: np.ndarray,
    eligible: np.ndarray,
    level: float,
    capacity: int,
    world: int | None = None,
) -> list[RingGroup] | None:
    """Groups of the split sequences (module docstring), one per ring; None once they
    take more than `world` ranks.

    Args:
        grid: S x (G - 1) member seconds of each split sequence's ring of 2 .. G ranks.
        lengths: tokens of each split sequence.
        degrees: each one's own ring degree.
        member: each one's own ring member seconds.
        eligible: those whose own ring lies inside a node (others stay alone).
        level: the most work a member may carry.
        capacity: L.
        world: the ranks there are (None: no limit).
    """
    sizes = np.arange(2, grid.shape[1] + 2)
    apart = np.flatnonzero(~eligible).tolist()  # the rest stay alone
    alone = [RingGroup((i,), int(degrees[i]), float(member[i])) for i in apart]
    order = np.flatnonzero(eligible)
    order = order[np.lexsort((-member[order] * degrees[order], -degrees[order]))]
    chunks = -(-lengths[order][:, None] // sizes[None, :])  # a member's tokens at each size
    work = grid[order]
    used = float(degrees[~eligible].sum())
    limit = np.inf if world is None else world + 1e-9
    lightest, shortest = (
        (float(work[:, -1].min()), int(chunks[:, -1].min())) if order.size else (0, 0)
    )
    # the groups a sequence may join, in WINDOW slots: each slot's group, the work and
    # tokens its members have room for at each size (none below its degree), its degree
    group = np.full(WINDOW, -1)
    slack = np.full((WINDOW, sizes.size), -np.inf)
    room = np.zeros((WINDOW, sizes.size), dtype=np.int64)
    degree = np.zeros(WINDOW, dtype=np.int64)
    members: list[list[int]] = []
    totals: list[np.ndarray] = []  # each group's member work at each size
    degrees_of: list[int] = []
    # a sequence's cost of joining each slot's group at each size: the ranks it adds
    # there, then, to prefer the fullest, the room left as a fraction (below 1/2) of the
    # level; `base` holds the part that is the slot's own
    scale = 0.5 / max(level, 1e-30)
    base = np.full((WINDOW, sizes.size), np.inf)
    free = list(range(WINDOW))  # a heap of the slots no open group holds
    opened = 0  # slots below it have held a group (the heap hands out the lowest first)
    # buffers the cost of joining is worked out in, one sequence after another
    cost_of, short_of, full_of = (np.empty((WINDOW, sizes.size)),
                                  np.empty((WINDOW, sizes.size), dtype=bool),
                                  np.empty((WINDOW, sizes.size), dtype=bool))  # fmt: skip
    for position, i in enumerate(order.tolist()):
        own, need, chunk = int(degrees[i]), work[position], chunks[position]
        joins = False
        if opened:
            cost, short, full = cost_of[:opened], short_of[:opened], full_of[:opened]
            np.greater(need, slack[:opened], out=short)  # too little work room
            np.greater(chunk, room[:opened], out=full)  # too few free tokens
            np.logical_or(short, full, out=short)
            np.subtract(base[:opened], need * scale, out=cost)
            np.copyto(cost, np.inf, where=short)
            k, size = divmod(int(cost.argmin()), sizes.size)
            joins = bool(cost[k, size] < own)  # fewer added ranks than its own ring
        if joins:
            used += int(sizes[size] - degree[k])
            if used > limit:
                return None
            slack[k] -= need
            room[k] -= chunk
            slack[k, :size] = -np.inf
            degree[k] = sizes[size]
            j = int(group[k])
            members[j].append(i)
            totals[j] += need
            degrees_of[j] = int(sizes[size])
            if slack[k, -1] < lightest or room[k, -1] < shortest:
                slack[k] = -np.inf  # no sequence fits any more
                heapq.heappush(free, k)
            base[k] = sizes - degree[k] + slack[k] * scale
            continue
        used += own
        if used > limit:
            return None
        # a new group takes the first slot no open group holds, else the oldest group's
        k = heapq.heappop(free) if free else int(group.argmin())
        opened = max(opened, k + 1)
        group[k] = len(members)
        slack[k] = level - need
        slack[k, : own - 2] = -np.inf
        room[k] = capacity - chunk
        degree[k] = own
        base[k] = sizes - degree[k] + slack[k] * scale
        members.append([i])
        totals.append(need.copy())
        degrees_of.append(own)
    grouped = [
        RingGroup(tuple(m), d, float(total[d - 2]))
        for m, d, total in zip(members, degrees_of, totals, strict=True)
    ]
    return grouped + alone


def alone_rings(degrees: np.ndarray, member: np.ndarray) -> list[RingGroup]:
    """One ring per split sequence, of its own degree and member seconds."""
    return [
        RingGroup((i,), int(d), float(m))
        for i, (d, m) in enumerate(zip(degrees.tolist(), member.tolist(), strict=True))
    ]


def fewest_ranks(grid: np.ndarray, degrees: np.ndarray, eligible: np.ndarray, level: float) -> int:
    """A lower bound on the ranks `group_rings`' rings take: the others' own degrees, and
    the eligible sequences' least rank-seconds (size x member seconds) over the level (a
    group's members carry at most the level), or their own degree where that is fewer
    (a sequence over the level alone stays alone)."""
    sizes = np.arange(2, grid.shape[1] + 2)
    shares = (grid[eligible] * sizes[None, :]).min(axis=1, initial=np.inf) / max(level, 1e-30)
    shares = np.minimum(shares, degrees[eligible])
    return int(degrees[~eligible].sum()) + int(np.ceil(shares.sum()))
