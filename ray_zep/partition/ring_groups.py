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

from dataclasses import dataclass

import numpy as np

from ray_zep.partition.group_kernel import group_kernel


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
    chunks = -(-lengths[order][:, None].astype(np.int64) // sizes[None, :])
    work = np.ascontiguousarray(grid[order], dtype=np.float64)
    used = float(degrees[~eligible].sum())
    limit = np.inf if world is None else world + 1e-9
    lightest, shortest = (
        (float(work[:, -1].min()), int(chunks[:, -1].min())) if order.size else (0.0, 0)
    )
    own = degrees[order].astype(np.int64)
    count, group_of, degree_of, totals = group_kernel(
        work, chunks, own, float(level), int(capacity), float(limit), used, lightest, shortest
    )
    if count < 0:
        return None
    members: list[list[int]] = [[] for _ in range(count)]
    for i, j in zip(order.tolist(), group_of.tolist(), strict=True):
        members[j].append(i)
    degree_of = degree_of[:count]
    seconds = totals[np.arange(count), degree_of - 2].tolist()
    grouped = [
        RingGroup(tuple(m), d, s)
        for m, d, s in zip(members, degree_of.tolist(), seconds, strict=True)
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
