"""`ring_groups.group_rings`' loop, compiled (`ray_zep.partition.compiled`): each split
sequence whose ring fits in a node, in turn, joins the open group it costs the fewest
extra ranks where that is fewer than its own ring, else opens one."""

from __future__ import annotations

import numpy as np

from ray_zep.partition.compiled import compiled

WINDOW = 96
"""Groups a sequence may join: the latest opened that still have room (the earlier
ones, opened for longer sequences, are the fullest)."""


@compiled
def group_kernel(
    work: np.ndarray,
    chunks: np.ndarray,
    own: np.ndarray,
    level: float,
    capacity: int,
    limit: float,
    used: float,
    lightest: float,
    shortest: int,
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """Groups of the sequences in order (rows of `work`: member seconds at ring sizes
    2 .. G; `chunks`: a member's tokens there; `own`: each one's own degree), each
    member's work within `level` and tokens within `capacity`. `used`: ranks the rings
    outside the groups take; `limit`: the most all may take; `lightest` and `shortest`:
    the least member work and tokens of any sequence at G (a group with less room left
    takes no more).

    Returns (groups, or -1 once the rings take more than `limit` ranks; each sequence's
    group; each group's degree; each group's member work at each size).

    A group sits in one of `WINDOW` slots: the work and tokens its members have room for
    at each size (none below its degree), and a sequence's cost of joining it at a size
    is the ranks it adds there, then, to prefer the fullest, the room left as a fraction
    (below 1/2) of the level. A full group frees its slot (the lowest free slot is taken
    first); with none free, a new group takes the oldest group's."""
    count, sizes_n = work.shape
    sizes = np.arange(2, sizes_n + 2)
    group = np.full(WINDOW, -1, dtype=np.int64)
    slack = np.full((WINDOW, sizes_n), -np.inf)
    room = np.zeros((WINDOW, sizes_n), dtype=np.int64)
    degree = np.zeros(WINDOW, dtype=np.int64)
    base = np.full((WINDOW, sizes_n), np.inf)  # the part of a joining cost that is the slot's
    free = np.ones(WINDOW, dtype=np.bool_)
    scale = 0.5 / max(level, 1e-30)
    group_of = np.empty(count, dtype=np.int64)
    degree_of = np.empty(count, dtype=np.int64)
    totals = np.empty((count, sizes_n))
    groups, opened = 0, 0  # slots below `opened` have held a group
    for position in range(count):
        best, k, size = np.inf, -1, -1
        for slot in range(opened):
            for s in range(sizes_n):
                if work[position, s] > slack[slot, s] or chunks[position, s] > room[slot, s]:
                    continue  # too little work room, or too few free tokens
                cost = base[slot, s] - work[position, s] * scale
                if cost < best:
                    best, k, size = cost, slot, s
        if k >= 0 and best < own[position]:  # fewer added ranks than its own ring
            used += sizes[size] - degree[k]
            if used > limit:
                return -1, group_of, degree_of, totals
            for s in range(sizes_n):
                slack[k, s] -= work[position, s]
                room[k, s] -= chunks[position, s]
            for s in range(size):
                slack[k, s] = -np.inf
            degree[k] = sizes[size]
            j = group[k]
            group_of[position] = j
            for s in range(sizes_n):
                totals[j, s] += work[position, s]
            degree_of[j] = sizes[size]
            if slack[k, sizes_n - 1] < lightest or room[k, sizes_n - 1] < shortest:
                for s in range(sizes_n):
                    slack[k, s] = -np.inf  # no sequence fits any more
                free[k] = True
            for s in range(sizes_n):
                base[k, s] = sizes[s] - degree[k] + slack[k, s] * scale
            continue
        used += own[position]
        if used > limit:
            return -1, group_of, degree_of, totals
        k = -1
        for slot in range(WINDOW):
            if free[slot]:
                k = slot
                break
        if k < 0:
            k = np.argmin(group)
        free[k] = False
        opened = max(opened, k + 1)
        group[k] = groups
        for s in range(sizes_n):
            slack[k, s] = level - work[position, s] if s >= own[position] - 2 else -np.inf
            room[k, s] = capacity - chunks[position, s]
        degree[k] = own[position]
        for s in range(sizes_n):
            base[k, s] = sizes[s] - degree[k] + slack[k, s] * scale
        group_of[position] = groups
        degree_of[groups] = own[position]
        for s in range(sizes_n):
            totals[groups, s] = work[position, s]
        groups += 1
    return groups, group_of, degree_of, totals
