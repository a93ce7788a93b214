"""Work-balanced placement: every rank gets the same modelled seconds, not the same tokens.

A step lasts as long as its busiest rank, so the planner fills ranks up to a level
of work (`WorkModel` seconds: linear and attention FLOPs at the per-length rates,
plus the ring transfers compute does not hide) and lets token counts differ, each
rank at most L (its memory bound). For a level lam, starting at the mean work:

1. Rings. A sequence stays whole unless its work exceeds lam or its tokens L; such
   a sequence gets the fewest ranks whose member work is at most lam (equal
   zigzag chunks: a ring waits for its slowest member at every step, so unequal
   chunks only add waiting). Where more ranks stop paying (the transfers are
   exposed) it keeps the degree of least member work. Sequences whose rings lie
   inside a node share one ring where that takes fewer ranks than their own
   (`group_rings`: one queue item, every step forwarding all their chunks).
2. Hierarchy. A ring of at most G ranks lies inside one node (best fit), a larger
   one on whole nodes and its rest on one more (`NodeSlots`: at most two inter-node
   rings share a node's NICs), members ordered node by node: intra-node rings send
   nothing over NICs, inter-node ones cross each node boundary once. A sequence
   that needs more than a node may instead exchange heads inside each node (or half
   node) and run its ring over those positions (USP: every GPU's hop through its own
   NIC, each step 1/U of the heads), with the fewest ranks whose member work is at
   most lam (`usp_grid.UspGrid`); it takes whichever of the two needs fewer
   ranks at the level (the lesser work by `MIN_GAIN` on as many, or where neither
   reaches it; the ring on near ties). `parallel.usp_groups=false` keeps rings.
   A ring inside a node whose members its tokens fill long before its work does may
   instead ride on a whole node of a ring or USP group across nodes, as one more ring
   over that node's GPUs after the host's (`hosting`: the host may take a few more
   ranks for the room); its own ranks are freed for the whole sequences. Before that, a
   split sequence may join a USP group of whole-node positions that has work and token
   room left, in the group's own item, the group taking at most one more node and fewer
   ranks than the sequence's own group would (`usp_guests`), or one of positions wider
   than a node, which takes no more (`wide_guests`), where the groups on their own take
   more ranks than there are.
3. Whole sequences, most work first, go to the rank whose work leaves the least
   room under lam among those with token room (best fit decreasing). A ring whose
   member work counted on keeping its peers' K/V beyond the model's budget, in the
   memory its members' unheld tokens free (`WorkModel.keeps_kv`), holds that room as
   tokens first (`level_fill.kept_room`), so that the fill leaves it free. One that fits
   under lam nowhere becomes a small ring inside a node where its work is worth one
   (`SMALL_RING_SHARE`), on ranks in no ring, or else on ranks of one node that are
   members of one same ring, run after it, where taking it whole would make the least
   loaded rank the busiest (`co_rings`); else it goes to the least loaded rank with
   token room; one
   that no rank has token room for fills the free tokens of the ranks with most; a
   level whose rings leave the whole sequences too few free tokens for that fails, as
   one whose rings do not fit the world does.

Levels rise from the mean until the rings fit the world; a level whose groups find no
nodes for their ranks, where the work model costs USP groups' exchanges in pieces
(`WorkModel.ulysses_pieces`), is placed again with them costed whole (fewer groups of
whole nodes, more rings that share nodes; every rank then within the level under either
cost). The level whose busiest rank is lowest wins (`level_scan`: which levels are
placed, each abandoned once it cannot win, sooner where an early bound says so, with
the same outcome). A sequence
that no group brings under a level (its transfers set its member work at every degree:
the batch's longest, bound by its NICs) is at its floor there: no ring rides on its
group (`ray_zep.partition.hosting`), and its members count their own work, so where they
are every level's busiest rank the first feasible level wins (counting them at the
level instead changed no row of `bench scale`'s grid once USP positions could span two
nodes: BENCHMARKS.md, twenty-seventh series). Where the rings
fit at no level, they shrink in proportion until they do (and then may share nodes);
where even their fewest ranks by tokens exceed the world, `balance` raises
PlacementError and the caller places the batch with capacity-aware, unequal splits.
Each level is placed on arrays of rank loads, so 4,096 ranks and thousands of sequences
take milliseconds to a few hundred.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np

from ray_zep.partition.exchange import Exchange
from ray_zep.partition.forward_room import forward_offsets, phase_seconds
from ray_zep.partition.hosting import Hosting, host_rings
from ray_zep.partition.layout import MIRRORED_ZIGZAG
from ray_zep.partition.level_fill import (
    SMALL_RING_SHARE,
    Placed,
    fill_whole,
    kept_room,
    shared_ring,
    small_ring_seconds,
    whole_sequences_fit,
)
from ray_zep.partition.level_scan import LevelScan, ScanRules
from ray_zep.partition.level_trace import LevelOutcome, LevelTry
from ray_zep.partition.node_slots import NodeSlots
from ray_zep.partition.plan import SeqPlacement, local_placement
from ray_zep.partition.ring_groups import RingGroup, alone_rings, fewest_ranks, group_rings
from ray_zep.partition.spread_whole import spread_whole
from ray_zep.partition.usp_grid import MIN_GAIN, UspGrid, positions_in_nodes
from ray_zep.partition.usp_guests import PartsTable, usp_guests
from ray_zep.partition.work import WorkModel
from ray_zep.topology import Topology

LEVELS = (1.0, 1.02, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3, 1.4, 1.5, 1.6, 2.0, 3.0)
"""Levels scanned, times the mean work per rank."""
PAST_FIRST = 4
"""Levels scanned past the first feasible one (a higher level may need fewer
transfer-bound ranks and end with a lower busiest rank). A level that cannot win is
abandoned early (`Placed.pruned`), so these cost little where they do not pay; on
`bench scale`'s grid, 4 rather than 2 lowers 16k-token arxiv rows by 5-11%."""
BISECTIONS = 4
"""Halvings of the gap between the last infeasible and the first feasible level. On `bench
scale`'s grid at 4k tokens per GPU (BENCHMARKS.md, sixty-ninth series) a fourth halving finds
a lower level that fits on five of 32 rows (7b arxiv at 64 and 1,024 GPUs, 7b github and 13b
prolong64k at 1,024, 7b prolong64k at 4,096), which step 0.1-0.3% faster, and no row slower;
plan_step's slowest plan rises from 63 to 70-78 ms at 1,024 GPUs and from 242 to 265-274 ms
at 4,096 (two runs). A fifth moved two of them a little further (13b prolong64k at 1,024 GPUs
1.1928 -> 1.1917 of its bound, 7b prolong64k at 4,096 1.2096 -> 1.2089) for 84 and 319 ms."""
BISECT_BELOW_OVERFLOW = False
"""Bisect below the lowest feasible level also where its placement ended busier than a
higher level's (its whole sequences overflowed it; a lower level leaves them less room
still). Off: on `bench scale`'s grid (64-4,096 GPUs) it never changed the placement, and
skipping it saves a few levels' work where the step plans slowest (chat, 1,024 GPUs)."""
BISECT_ABOVE_OVERFLOW = True
"""Where the lowest feasible level overflowed and a higher one won, halve the gap between
the two (`ray_zep.partition.level_scan`). On `bench scale`'s grid at 4k tokens per GPU it
moved two rows of 24 at 64-1,024 GPUs: 7b arxiv at 1,024 kept 1.119x the mean rank's work
for 1.150x (2.1% more tokens a second), 13b github at 1,024 1.4% more; the rest planned
the same. Since whole sequences ride as second rings (`ray_zep.partition.co_rings`),
13b github's first feasible level there no longer overflows past a higher one."""
BISECT_BELOW_LOST = False
"""Go on halving below a level that was abandoned at the busiest rank of a placement before
it (it cannot win). Off: the bisection then stops there, the levels below it having fewer
ranks free for the whole sequences that overflowed it. On `bench scale`'s batches (64-4,096
GPUs, 7b and 13b, four distributions, two seeds, 4k and 16k tokens per GPU: 112 batches)
no kept placement changed, and 7b arxiv at 4,096 GPUs places two levels fewer (the bisection
below its first feasible level found a lower level abandoned: 673 -> 528 ms a plan)."""
BISECT_ABOVE_LOST = 3
"""Where the halving below the first feasible level stops at a level abandoned at the
busiest rank so far (its whole sequences overflowed it), halve the gap between that level
and the best one this many times (`ray_zep.partition.level_scan`): a level between them
may hold its whole sequences and end lower than both. On 13b github at 4,096 GPUs (L =
7,680) the kept level 1.2 left 56 ranks idle, 1.175 overflowed, and 1.18125 ends 1.6%
less busy (1.3% more tokens a second). Over `bench scale`'s 4k batches (64-4,096 GPUs, 7b
and 13b, two seeds, three L, both K/V rooms: 384 plans) 1, 2 and 3 halvings lower the busiest
rank of 22, 41 and 51 of them (by 0.8-0.9% on average, at most 2.6%) for 4, 8 and 11% more
levels placed."""
HOSTED_RINGS = True
"""Rings inside a node may ride on whole nodes of rings across nodes
(`ray_zep.partition.hosting`)."""
USP_GUESTS = True
"""Split sequences may join a group of whole-node positions with work and token room
left, freeing their own ranks (`ray_zep.partition.usp_guests`), at levels whose groups
on their own take more ranks than there are."""
WHOLE_COST_RETRY = True
"""A level whose groups find no nodes, USP exchanges costed in pieces, is placed again with
them costed whole (module docstring). On `bench scale`'s 7b prolong64k batch at 4,096 GPUs
(L = 10,240) the level kept drops from 1.231 to 1.175 (BENCHMARKS.md, sixty-fifth
series; with four halvings of the level gap, 1.228 to 1.172)."""
FORWARD_TIE_BREAK = True
"""The kept level placed again with its fill keeping every rank's forward within the
level's share too, and kept where no busier and its forward's and backward's busiest
ranks add up to less (`ray_zep.partition.forward_room`)."""
LAYOUT = MIRRORED_ZIGZAG
"""How the work policy's rings cut their sequences: every message after its block has
passed the ring's last position carries half of it, and the ring's first position (the
rest of a ring that takes whole nodes, `_rest_first`) receives nothing but halves."""
DEGREE_ROUNDS = 24
"""Rounds of the vectorised degree search (each grows unfinished degrees by 1/8)."""


def balance(
    lengths: np.ndarray,
    topology: Topology,
    capacity: int,
    model: WorkModel,
    usp_groups: bool = True,
    trace: list[LevelTry] | None = None,
) -> list[SeqPlacement]:
    """Placements of a batch that equalise every rank's modelled work (module docstring).

    Args:
        lengths: sequence lengths (>= 1; their sum at most world x capacity).
        topology: nodes and GPUs per node.
        capacity: L, the most tokens one rank holds.
        model: the work model.
        usp_groups: sequences longer than a node may run as USP groups.
        trace: where given, each level tried is appended to it, with what it gave.

    Returns:
        One placement per sequence, in sequence order.

    Raises:
        PlacementError: rings of equal chunks cannot hold the batch within `capacity`.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    work = model.whole_seconds(lengths)
    mean = float(work.sum()) / topology.world_size
    # what each level may do with a sequence is costed once, for the sequences it may
    # happen to: split (work over the lowest level, or over L tokens), or become a small
    # ring (split, or worth `SMALL_RING_SHARE` of the lowest level: `fill_whole`)
    splittable = (work > mean * LEVELS[0]) | (lengths > capacity)
    ring_candidates = splittable | (work >= SMALL_RING_SHARE * (mean * LEVELS[0]))
    small = small_ring_seconds(lengths, topology.gpus_per_node, model, ring_candidates)
    usp = parts = None
    if usp_groups and topology.nodes > 1:
        usp = UspGrid.of(lengths, splittable, capacity, topology, model)
        parts = PartsTable(lengths, work, splittable, topology.nodes, model)

    whole: list = []  # the work model and USP tables with head exchanges costed whole

    def place(factor: float, prune_above: float, force: bool, failed) -> Placed | None:
        first: list[LevelTry] = []
        placed = _place_at(lengths, work, small, mean * factor, topology, capacity, model, usp,
                           parts, force, prune_above, first)  # fmt: skip
        nodes = any(t.outcome is LevelOutcome.NODES for t in first)
        if placed is None and nodes and model.ulysses_pieces > 1 and WHOLE_COST_RETRY and not force:
            # USP groups costed with their exchanges in pieces take whole nodes where rings
            # would share them: the level again with the exchanges costed whole, whose
            # placement then holds every rank within the level under either cost
            if not whole:
                whole.append(dataclasses.replace(model, ulysses_pieces=1))
                whole.append(UspGrid.of(lengths, splittable, capacity, topology, whole[0]))
                whole.append(PartsTable(lengths, work, splittable, topology.nodes, whole[0]))
            first = []
            placed = _place_at(lengths, work, small, mean * factor, topology, capacity,
                               *whole, force, prune_above, first)  # fmt: skip
        if failed is not None:
            failed.extend(first)
        return placed

    rules = ScanRules(LEVELS, PAST_FIRST, BISECTIONS, BISECT_BELOW_OVERFLOW, BISECT_ABOVE_OVERFLOW,
                      BISECT_BELOW_LOST, BISECT_ABOVE_LOST)  # fmt: skip
    scan = LevelScan(place, mean, rules, trace)
    placed = scan.best()
    if placed is None:  # rings want more ranks than there are at every level
        placed = scan.forced()
    scan.mark_kept(placed)
    if FORWARD_TIE_BREAK and not placed.pruned:
        factor = next((t.factor for t in scan.tried if t.placed is placed), None)
        if factor is not None:
            again = _place_at(lengths, work, small, mean * factor, topology, capacity, model, usp,
                              parts, prune_above=math.nextafter(placed.busiest, math.inf),
                              forward_room=True)  # fmt: skip
            if (
                again is not None
                and not again.pruned
                and (phase_seconds(again, lengths, model) < phase_seconds(placed, lengths, model))
            ):
                placed = again
    spread_whole(placed, lengths, work, capacity)
    return _placements(lengths, placed, model)


def _failed(failed: list[LevelTry] | None, outcome: LevelOutcome, ranks: int = 0) -> None:
    """Records why a level failed in `failed` (when given); None, `_place_at`'s answer."""
    if failed is not None:
        failed.append(LevelTry(0.0, outcome, ranks=ranks))


def _place_at(
    lengths: np.ndarray,
    work: np.ndarray,
    small: np.ndarray,
    level: float,
    topology: Topology,
    capacity: int,
    model: WorkModel,
    usp_grid: UspGrid | None,
    parts: PartsTable | None = None,
    force: bool = False,
    prune_above: float = float("inf"),
    failed: list[LevelTry] | None = None,
    forward_room: bool = False,
) -> Placed | None:
    """The placement at `level`, or None when its rings need more than the world
    (`usp_grid`: USP groups compete with rings; `parts`: they take guests); pruned
    (`Placed.pruned`) once a rank's work reaches `prune_above`. Where it returns None,
    `failed` (when given) gets why."""
    world, gpus = topology.world_size, topology.gpus_per_node
    split = (work > level) | (lengths > capacity)
    if world == 1:
        split[:] = False
    seqs = np.flatnonzero(split)
    degrees, member = _degrees(lengths[seqs], level, capacity, world, model)
    usp = np.zeros(seqs.size, dtype=np.int64)  # U of a USP group, 0 for a ring
    if seqs.size and usp_grid is not None:
        degrees, member, usp = usp_grid.choose(seqs, degrees, member, level)
    host = np.full(seqs.size, -1, dtype=np.int64)  # the group each guest joins
    if USP_GUESTS and not force and parts is not None and degrees.sum() > world:
        # guests free ranks, so only where the groups on their own need more than there are
        host, degrees, member = usp_guests(seqs, degrees, member, usp, level, capacity, gpus,
                                           parts, world, float(work[~split].sum()))  # fmt: skip
    floor = member > level  # no degree brings these under the level
    own = np.where(host < 0, degrees, 0)  # ranks of each one's own group; guests take none
    eligible = (usp == 0) & (degrees <= gpus) & (host < 0)
    fewest = 0 if force else fewest_ranks(small[seqs], own, eligible, level)
    if fewest > world:
        return _failed(failed, LevelOutcome.RINGS, fewest)  # even perfectly shared rings
    rings = group_rings(small[seqs], lengths[seqs], own, member, eligible, level, capacity,
                        None if force else world)  # fmt: skip
    if rings is not None and (host >= 0).any():
        rings = _with_guests(rings, host, member)
    hosted = None
    if HOSTED_RINGS and not force and gpus > 1 and rings is not None and (degrees > gpus).any():
        # the rings fit the world here, and a host takes guests only where that frees ranks
        hosted = host_rings(rings, lengths[seqs], small[seqs, -1], usp, floor, level, capacity,
                            gpus, model)  # fmt: skip
    if hosted is None and (rings is None or sum(r.degree for r in rings) > world):
        if not force:
            return _failed(failed, LevelOutcome.RINGS)
        degrees = _shrink(degrees, np.maximum(2, -(-lengths[seqs] // capacity)), world)
        member = model.alone_ring_seconds(lengths[seqs], degrees)
        usp[:] = 0
        rings = alone_rings(degrees, member)
    assignment = _assign(rings, hosted, topology, force)
    if assignment is None:
        return _failed(failed, LevelOutcome.NODES)  # an inter-node ring's rest has no node
    rings, hosted, assigned = assignment  # hosted None: the widened hosts' rests found none
    guests = hosted.guest_rings() if hosted is not None else set()
    placed = Placed.empty(world)
    index: list[int] = []
    loads: list[float] = []
    held: list[int] = []
    ring_degrees = np.asarray([r.degree for r in rings], dtype=np.int64)
    seq_of, size_of, u_of = seqs.tolist(), lengths.tolist(), usp.tolist()  # lists: per ring
    for k in np.argsort(-ring_degrees, kind="stable").tolist():
        if k in guests:
            continue
        ring, ranks = rings[k], assigned[k]
        d = ring.degree
        if len(ranks) < d:
            return _failed(failed, LevelOutcome.RINGS)  # forced past the world's GPUs
        work_k = ring.member_seconds
        members = [seq_of[j] for j in ring.members]
        sizes = [size_of[seq] for seq in members]
        u = u_of[ring.members[0]]  # a USP group's (its guests run at its U)
        if len(members) == 1 or u:
            fragmented = u and not positions_in_nodes(ranks, u, gpus)
            if fragmented:  # a plain ring (forced: no guests)
                work_k = float(model.alone_ring_seconds(np.asarray(sizes[:1]),
                                                        np.asarray([d]))[0])  # fmt: skip
            elif u:
                placed.ulysses.update((seq, u) for seq in members)
        ring_held = shared_ring(placed, members, sizes, ranks)
        reserve = kept_room(placed, members, sizes, ranks, max(ring_held), capacity, model)
        held += [h + reserve for h in ring_held]
        index += ranks
        loads += [work_k] * len(ranks)
    placed.load[index] += np.asarray(loads, dtype=np.float64)  # the rings' ranks are disjoint
    placed.tokens[index] += np.asarray(held, dtype=np.int64)
    placed.in_ring[index] = True
    if hosted is not None:
        _place_guests(placed, hosted, rings, assigned, seqs, lengths, gpus)
    placed.ring_ranks = int(placed.in_ring.sum())
    placed.ring_work = float(placed.load[placed.in_ring].mean()) if placed.ring_ranks else 0.0
    wholes = np.flatnonzero(~split)
    held = int(placed.tokens.sum())  # what the rings hold (`whole_sequences_fit`)
    if placed.busiest >= prune_above:
        placed.pruned = True
    else:
        offsets = None
        if forward_room:
            offsets = forward_offsets(placed, lengths, work, wholes, level, model)
            if offsets is None:
                return None  # the fill as without
        bound = prune_above
        if offsets is not None:  # the fill sees those ranks fuller, its bound as much higher
            placed.load += offsets
            bound = prune_above + float(offsets.max())
        fill_whole(placed, wholes[np.argsort(-work[wholes], kind="stable")], lengths, work,
                   small, level, capacity, topology, model, bound)  # fmt: skip
        if offsets is not None:
            placed.load -= offsets
            if placed.busiest >= prune_above:
                placed.pruned = True
    if placed.pruned:  # could its fill have run out of tokens past where it stopped?
        placed.fill_fits = whole_sequences_fit(held, world, wholes, lengths, work, level,
                                               capacity, gpus, model)  # fmt: skip
    return placed


def _with_guests(rings: list[RingGroup], host: np.ndarray, member: np.ndarray) -> list[RingGroup]:
    """`rings` with each guest (`host` >= 0) among its host's members, the host's member
    seconds (`member`) as its guests make them; the guests' own (empty) rings dropped."""
    guests: dict[int, list[int]] = {}
    for guest in np.flatnonzero(host >= 0).tolist():
        guests.setdefault(int(host[guest]), []).append(guest)
    out = []
    for ring in rings:
        if ring.degree == 0:
            continue
        first = ring.members[0]
        if len(ring.members) == 1 and first in guests:  # its degree as its guests grew it
            ring = RingGroup((first, *guests[first]), ring.degree, float(member[first]))
        out.append(ring)
    return out


def _assign(
    rings: list[RingGroup], hosted: Hosting | None, topology: Topology, force: bool
) -> tuple[list[RingGroup], Hosting | None, list[tuple[int, ...]]] | None:
    """(the rings, their hosting, the ranks of each) as `NodeSlots` assigns them: guests
    take none of their own. Where the hosts' widened rings find no node for their rests,
    the level's own rings instead (hosting None); None where neither is assigned."""
    tries = [(hosted.rings, hosted)] if hosted is not None else []
    for candidate, hosting in [*tries, (rings, None)]:
        guests = hosting.guest_rings() if hosting is not None else set()
        degrees = np.asarray([0 if k in guests else r.degree for k, r in enumerate(candidate)],
                             dtype=np.int64)  # fmt: skip
        assigned = NodeSlots(topology.nodes, topology.gpus_per_node).assign(degrees, force)
        if assigned is not None:
            return candidate, hosting, assigned
    return None


def _place_guests(
    placed: Placed,
    hosted: Hosting,
    rings: list[RingGroup],
    assigned: list[tuple[int, ...]],
    seqs: np.ndarray,
    lengths: np.ndarray,
    gpus: int,
) -> None:
    """Each host's whole nodes take their guests' sequences as one ring over the node's
    GPUs (`ray_zep.partition.hosting`), on top of the host's load and tokens."""
    for host, per_node in hosted.guests.items():
        ranks = np.asarray(assigned[host], dtype=np.int64)
        nodes, counts = np.unique(ranks // gpus, return_counts=True)
        whole = nodes[counts == gpus]
        for node, guests in zip(whole.tolist(), per_node, strict=True):
            if not guests:
                continue
            members = seqs[[i for g in guests for i in rings[g].members]].tolist()
            sizes = lengths[members].tolist()
            node_ranks = tuple(range(node * gpus, (node + 1) * gpus))
            placed.tokens[list(node_ranks)] += shared_ring(placed, members, sizes, node_ranks)
            placed.load[list(node_ranks)] += sum(hosted.guest_seconds[g] for g in guests)
            placed.resent.add(node_ranks)


def _degrees(
    lengths: np.ndarray, level: float, capacity: int, world: int, model: WorkModel
) -> tuple[np.ndarray, np.ndarray]:
    """Ranks of each ring (fewest with member work <= level) and its member work."""
    if lengths.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    low = np.maximum(2, -(-lengths // capacity))
    guess = np.ceil(model.whole_seconds(lengths) / max(level, 1e-30))
    degree = np.minimum(np.maximum(low, guess), world).astype(np.int64)
    seconds = model.alone_ring_seconds(lengths, degree)
    for _ in range(DEGREE_ROUNDS):
        over = (seconds > level) & (degree < world)
        if not over.any():
            break
        grown = np.minimum(world, degree + np.maximum(1, degree // 8))
        trial = model.alone_ring_seconds(lengths, grown)
        better = over & (trial < seconds * (1 - MIN_GAIN))
        if not better.any():
            break
        degree = np.where(better, grown, degree)
        seconds = np.where(better, trial, seconds)
    return degree, seconds


def _shrink(degrees: np.ndarray, low: np.ndarray, world: int) -> np.ndarray:
    """Degrees cut in proportion until they fit the world, none below `low`."""
    while degrees.sum() > world and (degrees > low).any():
        scale = world / degrees.sum()
        degrees = np.maximum(low, np.minimum(degrees - 1, np.floor(degrees * scale))).astype(
            np.int64
        )
    return degrees


def _placements(lengths: np.ndarray, placed: Placed, model: WorkModel) -> list[SeqPlacement]:
    """The placements of `placed`; a ring keeps the forward's K/V for the backward where
    its fullest keeper, over all the ring's sequences, stays within the model's budget
    (`WorkModel.keeps_kv`): one exchange for all of them, so that they stay one ring."""
    kept: dict[tuple[int, ...], int] = {}  # ring ranks -> tokens its fullest keeper keeps
    positions_of: dict[int, list[int]] = {}  # ring sequence -> tokens of each position
    sizes = lengths.tolist()
    for seq, (ranks, counts) in placed.groups.items():
        u = placed.ulysses.get(seq, 1)
        positions = list(counts) if u == 1 else [int(sum(counts[i : i + u]))
                                                 for i in range(0, len(counts), u)]  # fmt: skip
        positions_of[seq] = positions
        kept[ranks] = kept.get(ranks, 0) + sizes[seq] - min(positions)
    keeps_of: dict[tuple, bool] = {}  # (ring ranks, U) -> whether it keeps its K/V
    out = []
    for seq, n in enumerate(sizes):
        rank = placed.local.get(seq)
        if rank is not None:
            out.append(local_placement(seq, n, rank))
            continue
        ranks, counts = placed.groups[seq]
        u, positions = placed.ulysses.get(seq, 1), positions_of[seq]
        keeps = keeps_of.get((ranks, u))
        if keeps is None:
            keeps = ranks in placed.kept_rings or (
                ranks not in placed.resent and bool(model.keeps_kv(kept[ranks], u))
            )
            keeps_of[ranks, u] = keeps
        exchange = Exchange.RING_KEPT if keeps else Exchange.RING
        k = _rest_first(ranks, u, model.cost.topology.gpus_per_node)
        ranks, counts = ranks[k * u :] + ranks[: k * u], [*counts[k * u :], *counts[: k * u]]
        positions = positions[k:] + positions[:k]
        if u > 1:  # ring positions of U members each: the position's tokens, its members'
            out.append(SeqPlacement(seq, n, ranks, LAYOUT.bounds_for_counts(positions),
                                    ulysses=u, exchange=exchange, parts=tuple(counts),
                                    layout=LAYOUT))  # fmt: skip
            continue
        out.append(SeqPlacement(seq, n, ranks, LAYOUT.bounds_for_counts(counts),
                                exchange=exchange, layout=LAYOUT))  # fmt: skip
    return out


def _rest_first(ranks: tuple[int, ...], u: int, gpus: int) -> int:
    """The ring position to put first: on a ring across nodes, the first position on the
    node holding the fewest of its positions (the rest of a ring that takes whole nodes)
    after a position on another node, so that every message into it, and so into that
    node, carries half a block (`LAYOUT`); 0 where every node holds as many."""
    nodes = [rank // gpus for rank in ranks[::u]]
    if nodes[0] == nodes[-1]:  # inside one node (the ranks come ascending)
        return 0
    held = Counter(nodes)
    fewest = min(held.values())
    if fewest == max(held.values()):
        return 0
    return next(p for p, node in enumerate(nodes)
                if held[node] == fewest and node != nodes[p - 1])  # fmt: skip
