"""The levels of work the balanced placement tried for a batch, and what each gave
(`ray_zep.partition.balance`): what `ray-zep plan` says about why the busiest rank sits
where it does."""

from __future__ import annotations

import math
from enum import Enum
from typing import NamedTuple


class LevelOutcome(Enum):
    """What one level gave."""

    KEPT = "kept"
    """Placed, and the placement the planner returned."""
    PLACED = "placed"
    PRUNED = "pruned"
    """Abandoned once a rank reached the busiest rank of a better level, or a lower bound
    the scan set (`ray_zep.partition.level_scan`; then `busiest` is that bound)."""
    RINGS = "rings"
    """The rings the level needs take more ranks than the world."""
    NODES = "nodes"
    """The rings fit the world by count, but a ring across nodes finds no node for the
    ranks beyond its whole nodes."""
    TOKENS = "tokens"
    """The rings left the whole sequences too few free tokens."""


class LevelTry(NamedTuple):
    """One level tried: its work over the mean rank's, what it gave and, where placed or
    kept, its busiest rank's modelled work over the mean, and where abandoned at a
    bound a better placement set before its own (`ray_zep.partition.level_scan`), that
    bound: its busiest rank would have ended there or above; where its rings need
    more ranks than there are even perfectly shared, at least how many (`ranks`; 0 where
    not counted: the rings as grouped overflow the world); where placed, the ranks its
    rings and USP groups take (`ring_ranks`) and their members' mean work over the level
    (`ring_fill`, before the whole sequences: the group sizes the nodes allow leave the
    rest under it)."""

    factor: float
    outcome: LevelOutcome
    busiest: float = float("nan")
    ranks: int = 0
    ring_ranks: int = 0
    ring_fill: float = float("nan")


_WHY = {
    LevelOutcome.RINGS: "the rings alone need more ranks than there are",
    LevelOutcome.NODES: "the rings across nodes find no nodes for their rests",
    LevelOutcome.TOKENS: "the whole sequences lack token room beside the rings",
}


def level_sentence(levels: tuple[LevelTry, ...], world: int) -> str:
    """The level the plan kept and why no lower one was kept; empty for a plan made
    without levels (every placement but zeppelin's work policy). `world`: the ranks
    there are."""
    kept = next((t for t in levels if t.outcome is LevelOutcome.KEPT), None)
    if kept is None:
        return ""
    text = f"work level {kept.factor:.2f}x the mean rank's"
    if kept.ring_ranks and not math.isnan(kept.ring_fill):
        text += (f" (its rings take {kept.ring_ranks:,} of {world:,} ranks, their members at "
                 f"{kept.ring_fill:.2f}x the level on average)")  # fmt: skip
    reasons = []
    for outcome, why in _WHY.items():
        tries = sorted((t for t in levels if t.outcome is outcome and t.factor < kept.factor),
                       key=lambda t: t.factor)  # fmt: skip
        if tries:
            low, high = tries[0].factor, tries[-1].factor
            span = f"{low:.2f}x" if low == high else f"{low:.2f}-{high:.2f}x"
            counted = [t for t in tries if t.ranks]
            if counted:  # the lowest level's count: the most ranks the rings need
                why += f" (at least {counted[0].ranks:,} of {world:,} at {counted[0].factor:.2f}x)"
            reasons.append(f"at {span} {why}")
    for t in levels:  # placed, or abandoned at a known bound, and busier than the kept
        if t.factor >= kept.factor or math.isnan(t.busiest):
            continue
        if t.outcome is LevelOutcome.PLACED:
            reasons.append(f"at {t.factor:.2f}x a rank ended at {t.busiest:.2f}x")
        elif t.outcome is LevelOutcome.PRUNED:
            reasons.append(f"at {t.factor:.2f}x a rank passed {t.busiest:.2f}x")
    if reasons:
        text += "; lower levels: " + ", ".join(reasons)
    return text
