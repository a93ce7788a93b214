"""Which rows move between the attention and linear layouts (pure computation).

Per rank, from a `RemapPlan` (see `ray_zep.remap.solver` for the token order):
a sender keeps rows [0, B) of its attention layout and sends rows [B, A) piece
by piece to ascending destinations; a receiver's linear layout is its attention
rows followed by the pieces it receives, in ascending source order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_zep.remap.solver import RemapPlan


@dataclass(frozen=True)
class RankRemap:
    """One rank's part of a remap.

    Attributes:
        rank: the rank.
        attention_tokens: A, rows in the attention layout.
        linear_tokens: B, rows in the linear layout.
        sends: (destination, rows) in ascending destination: the tail of the
            attention layout, in order.
        recvs: (source, rows) in ascending source: appended to the attention rows.
    """

    rank: int
    attention_tokens: int
    linear_tokens: int
    sends: tuple[tuple[int, int], ...]
    recvs: tuple[tuple[int, int], ...]

    @classmethod
    def from_plan(cls, plan: RemapPlan, rank: int) -> RankRemap:
        sends = tuple((dst, n) for src, dst, n in plan.transfers if src == rank)
        recvs = tuple((src, n) for src, dst, n in plan.transfers if dst == rank)
        return cls(rank, plan.counts_before[rank], plan.counts_after[rank], sends, recvs)


def linear_sources(plan: RemapPlan) -> list[list[tuple[int, int, int]]]:
    """For every rank, its linear layout as (source rank, first row, end row) ranges of
    the sources' attention layouts."""
    world = len(plan.counts_before)
    layout = [[(r, 0, min(plan.counts_before[r], plan.counts_after[r]))] for r in range(world)]
    cursor = list(plan.counts_after)
    for src, dst, n in plan.transfers:  # sorted by source, then destination
        layout[dst].append((src, cursor[src], cursor[src] + n))
        cursor[src] += n
    return [[piece for piece in pieces if piece[2] > piece[1]] for pieces in layout]


def to_linear_layout(arrays: list[np.ndarray], plan: RemapPlan) -> list[np.ndarray]:
    """Every rank's array (attention layout) rearranged into the linear layout."""
    return [
        np.concatenate([arrays[src][a:b] for src, a, b in pieces]) if pieces else arrays[rank][:0]
        for rank, pieces in enumerate(linear_sources(plan))
    ]
