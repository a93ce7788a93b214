"""Whole sequences dealt again over the ranks that hold nothing else, once a level is kept
(`ray_zep.partition.balance`).

The level's fill deals whole sequences best fit: each to the rank it leaves the least
room under the level, so that the heaviest later ones still find room. Among the ranks
that hold no ring that packs a few of them up to the level and leaves others empty: on
`bench scale`'s 7b prolong64k batch at 1,024 GPUs one rank took three documents (5,090,
3,589 and 734 tokens, 1.14x the mean rank's work) while five ranks beside it held none.
The level does not count that (every rank is within it), but the step does: those ranks
compute only linear-heavy short sequences, whose forward is a larger share of their work
than a ring member's, and that rank's forward was 1.25x the mean rank's, the forward's
slowest by 8%.

Once the scan has kept a level, the whole sequences on ranks in no ring are dealt again
over those ranks, most work first, each to the least loaded of them with token room (the
longest-processing-time rule), and the new deal is kept where it lowers their busiest
rank. Ranks of rings, and the whole sequences on them, stay as the fill left them; the
level scan and its outcome are unchanged.
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition.fill import place_whole
from ray_zep.partition.level_fill import Placed


def spread_whole(placed: Placed, lengths: np.ndarray, work: np.ndarray, capacity: int) -> bool:
    """Deals again the whole sequences of `placed`'s ranks in no ring over those ranks
    (module docstring, `fill.place_whole`'s deal), writing `placed.local`, `load` and
    `tokens` where that lowers their busiest rank. Returns whether it did."""
    free = ~placed.in_ring
    for ranks, _ in placed.groups.values():
        free[list(ranks)] = False
    seqs = [seq for seq, rank in placed.local.items() if free[rank]]
    if len(seqs) < 2:
        return False
    ranks = np.flatnonzero(free)
    order = sorted(seqs, key=lambda seq: (-float(work[seq]), seq))
    dealt = place_whole([int(lengths[seq]) for seq in order], ranks.size, capacity,
                        [float(work[seq]) for seq in order])  # fmt: skip
    if dealt is None:
        return False  # the fill's own deal stays
    bins, room, loads = dealt
    if loads.max() >= float(placed.load[ranks].max()):
        return False
    placed.load[ranks] = loads
    placed.tokens[ranks] = capacity - room
    placed.local.update(zip(order, ranks[bins].tolist(), strict=True))
    return True
