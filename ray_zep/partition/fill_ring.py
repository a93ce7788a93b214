"""`fill`: every rank filled, in node order, to the batch's mean modelled work.

Sequences go densest first (modelled seconds per token, `WorkModel.whole_seconds`: the
longer a sequence, the more each of its tokens costs). Each is poured into the ranks in
node order: the current rank takes as many of its tokens as its share of the work (the
batch's mean per rank) and its free tokens (L) allow, and the rest flows on to the next
rank. A sequence poured over several ranks is one ring over them in unequal zigzag
shares: a zigzag member's causal pairs are about its tokens x n / 2 wherever it sits,
so its work follows its tokens. A rank may so hold the end of one ring, the start of
the next and whole short sequences, and a ring of consecutive ranks stays inside a node
when the node can hold it.

Work is not the step, though: a ring whose pieces are short waits on its K/V
transfers. So no piece of a cut sequence is shorter than the link's crossover length
(`CostModel.crossover_tokens`: the chunk above which a ring step's compute hides its
transfer; the inter-node one, over all of a node's NICs when routed, for a ring that
leaves the node), up to L: a rank holding a piece of a dense sequence may then exceed
the mean work, and the ranks after it take less. A sequence shorter than `MIN_PIECE`
tokens is never cut (a piece that short costs more in kernel rate and ring hops than it
balances): one the current rank has no room for goes whole to the next rank that has.
Pieces are shorter only where the ranks' free tokens leave no choice.
"""

from __future__ import annotations

import time

import numpy as np

from ray_zep.config import ParallelConfig
from ray_zep.costmodel import CostModel
from ray_zep.errors import PlacementError
from ray_zep.model_shapes import ModelShape
from ray_zep.parallel.axes import SEQUENCE_AXES, Placement
from ray_zep.partition.fill import check_total, water_fill
from ray_zep.partition.layout import ZIGZAG
from ray_zep.partition.plan import AttentionPlan, SeqPlacement, local_placement
from ray_zep.partition.spec import Bench, PlacementSpec, Variant, listed_in
from ray_zep.partition.work import WorkModel
from ray_zep.topology import LinkKind, Topology

MIN_PIECE = 256
"""Tokens below which a sequence stays whole and a piece is not cut (at most L / 2)."""


def plan_fill(
    lengths: np.ndarray,
    topology: Topology,
    capacity: int,
    shape: ModelShape,
    parallel: ParallelConfig,
) -> AttentionPlan:
    """The `fill` plan of a batch (module docstring).

    Raises:
        PlacementError: the batch does not fit world x L tokens.
    """
    started = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    world = topology.world_size
    check_total(lengths, world, capacity, Placement.FILL.value)
    model = WorkModel.create(shape, topology, routed=parallel.routing, dkv_wire=parallel.dkv_wire)
    work = model.whole_seconds(lengths)
    density = work / np.maximum(lengths, 1)
    pour = _Pour(world, capacity, float(work.sum()) / world, min(MIN_PIECE, capacity // 2))
    pieces = _crossovers(CostModel.create(shape, topology), parallel.routing, capacity)
    gpus = topology.gpus_per_node
    placements: list[SeqPlacement | None] = [None] * lengths.size
    for seq in np.argsort(-density, kind="stable").tolist():
        n = int(lengths[seq])
        counts = pour.whole(n, float(density[seq])) if n < pour.min_piece else None
        if counts is None:
            within = pour.at // gpus == (pour.at + -(-n // pieces[0]) - 1) // gpus
            piece = pieces[0] if within else pieces[1]
            counts = pour.cut(n, float(density[seq]), max(pour.min_piece, piece))
        ranks = tuple(sorted(counts))
        if len(ranks) == 1:
            placements[seq] = local_placement(seq, n, ranks[0])
        else:
            bounds = ZIGZAG.bounds_for_counts([counts[r] for r in ranks])
            placements[seq] = SeqPlacement(seq, n, ranks, bounds)
    plan = AttentionPlan(Placement.FILL, topology, capacity, tuple(placements))
    plan.planner_seconds = time.perf_counter() - started
    return plan


def _crossovers(cost: CostModel, routed: bool, capacity: int) -> tuple[int, int]:
    """The shortest pieces worth cutting for a ring inside a node and one across nodes
    (at most L)."""
    inter = cost.crossover_tokens(LinkKind.INTER_NODE)
    if routed:  # the ring's bytes spread over every NIC of the node
        inter = -(-inter // cost.topology.nics_per_node)
    return min(capacity, cost.crossover_tokens(LinkKind.INTRA_NODE)), min(capacity, inter)


class _Pour:
    """The ranks' free tokens and work budgets, and the rank being filled."""

    def __init__(self, world: int, capacity: int, target: float, min_piece: int) -> None:
        self.free = np.full(world, capacity, dtype=np.int64)
        self.budget = np.full(world, target, dtype=np.float64)
        self.min_piece = max(1, min_piece)
        self.at = 0

    def _take(self, rank: int, tokens: int, density: float) -> None:
        self.free[rank] -= tokens
        self.budget[rank] -= tokens * density
        last = self.free.size - 1
        while self.at < last and (self.budget[self.at] <= 0 or not self.free[self.at]):
            self.at += 1

    def whole(self, n: int, density: float) -> dict[int, int] | None:
        """The sequence whole on the first rank from the current one with room (any
        rank with room after that); None when no rank has room for it."""
        later = np.flatnonzero(self.free[self.at :] >= n)
        if later.size:
            rank = self.at + int(later[0])
        else:
            room = np.flatnonzero(self.free >= n)
            if not room.size:
                return None
            rank = int(room[np.argmax(self.budget[room])])
        self._take(rank, n, density)
        return {rank: n}

    def cut(self, n: int, density: float, piece: int) -> dict[int, int]:
        """The sequence poured over ranks from the current one on, each taking its
        budget's worth (at least `piece` tokens, the rest when that would leave less),
        the remainder, past the last rank, water-filled over every rank with room."""
        counts: dict[int, int] = {}
        left = n
        roomy = self.at + np.flatnonzero(self.free[self.at :] >= min(piece, n))
        for rank in roomy.tolist():
            if not left:
                break
            room = int(self.free[rank])
            if room < min(piece, left):
                continue
            share = max(piece, int(self.budget[rank] / density))
            take = min(left, room, share)
            if left - take < piece:
                take = min(left, room)
            counts[rank] = counts.get(rank, 0) + take
            left -= take
            self._take(rank, take, density)
        if left:
            spread = water_fill(left, self.free)
            for rank in np.flatnonzero(spread).tolist():
                counts[rank] = counts.get(rank, 0) + int(spread[rank])
                self._take(rank, int(spread[rank]), density)
        if not counts:
            raise PlacementError(f"fill: a sequence of {n} tokens finds no room")
        return counts


SPEC = PlacementSpec(
    SEQUENCE_AXES[Placement.FILL],
    plan_fill,
    # consecutive ranks' rings cross node boundaries where a node is full: routed
    variants={Placement.FILL.value: Variant(Placement.FILL, routed=True)},
    # not in bench scale's default list: behind zeppelin in every case of its grid, and
    # its rings (a rank in several) play event by event, 4 minutes for 256 GPUs of chat
    listed=listed_in(Bench.PARTITION),
    reads=("routing", "dkv_wire"),
)
