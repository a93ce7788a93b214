"""The attention plan: where every token of a global batch lives and how attention runs.

Every planner (Zeppelin and the baselines) produces an `AttentionPlan`; the
attention engine executes it and the simulator costs it, so the two never
disagree about a strategy.

A sequence is placed on a group of ranks laid out as R ring positions x U
Ulysses members, `ranks[r * U + u]`:

- its tokens are cut into chunks at `bounds` by its `layout`
  (`ray_zep.partition.layout`: zigzag, 2R chunks with ring position r holding chunks
  r and 2R-1-r, unless a placement chooses another);
- the tokens of ring position r (its chunks one after the other) are cut into U
  contiguous parts, member u holding part u. Before attention the Ulysses
  members exchange heads for tokens, so each computes H/U heads over all of the
  position's tokens; R = 1 then means plain Ulysses and U = 1 plain ring.

Chunks may differ in length (planners balance them to within a token, or fill
the free space of their ranks) and may be empty, so no sequence is padded and
no zero-length segment reaches a kernel: empty pieces are simply absent. A
group of one rank is the local zone: the sequence is attended on that rank
with no communication.

Sequences with the same group form one queue item; the engine runs items in
the order inter-node -> intra-node -> local, then by group, and every rank
derives the same order from the plan alone.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import numpy as np

from ray_zep.errors import PlacementError
from ray_zep.parallel.axes import Placement
from ray_zep.partition.carried import Carried
from ray_zep.partition.exchange import EXCHANGES, Exchange, ExchangeKind
from ray_zep.partition.layout import ARRAY_RING, ZIGZAG, Layout
from ray_zep.partition.level_trace import LevelTry
from ray_zep.topology import LinkKind, Topology


class Zone(Enum):
    """The link a sequence's attention communicates over."""

    INTER_NODE = "inter_node"
    INTRA_NODE = "intra_node"
    LOCAL = "local"


ZONE_ORDER = (Zone.INTER_NODE, Zone.INTRA_NODE, Zone.LOCAL)
"""Execution order of the engine's queues."""
_ZONE_RANK = {zone: at for at, zone in enumerate(ZONE_ORDER)}


@dataclass(frozen=True)
class Fragment:
    """Tokens [start, end) of sequence `seq` held by one rank."""

    seq: int
    start: int
    end: int
    zone: Zone

    @property
    def length(self) -> int:
        return self.end - self.start


class SeqPlacement(NamedTuple):
    """Where one sequence lives (a named tuple: planners build thousands per batch).

    Attributes:
        seq: index of the sequence in the batch.
        length: its tokens (>= 1).
        ranks: its group, ring-position major (R x U ranks, all distinct).
        bounds: R x C + 1 non-decreasing chunk offsets from 0 to `length` (C: the
            layout's slots).
        ulysses: U, Ulysses members per ring position.
        exchange: how K and V move between ring positions.
        parts: tokens of each member (R x U entries) when U > 1; None splits each
            ring position's tokens evenly over its members.
        layout: how the chunks are laid out over the ring positions.
    """

    seq: int
    length: int
    ranks: tuple[int, ...]
    bounds: tuple[int, ...]
    ulysses: int = 1
    exchange: Exchange = Exchange.RING
    parts: tuple[int, ...] | None = None
    layout: Layout = ZIGZAG

    @property
    def ring_size(self) -> int:
        return len(self.ranks) // self.ulysses

    def position_ranges(self, position: int) -> list[tuple[int, int]]:
        """Non-empty token ranges of ring position `position`: its chunks in order."""
        chunks = self.layout.position_chunks(self.ring_size, position)
        ranges = [(self.bounds[c], self.bounds[c + 1]) for c in chunks]
        return _merge([(a, b) for a, b in ranges if b > a])

    def slot_tokens(self, position: int) -> tuple[int, ...]:
        """Tokens of each of the layout's slots at ring position `position`."""
        chunks = self.layout.position_chunks(self.ring_size, position)
        return tuple(self.bounds[c + 1] - self.bounds[c] for c in chunks)

    def position_tokens(self, position: int) -> int:
        return sum(self.slot_tokens(position))

    def member_ranges(self, member: int) -> list[tuple[int, int]]:
        """Non-empty token ranges held by `ranks[member]`, in its layout order."""
        position, part = divmod(member, self.ulysses)
        ranges = self.position_ranges(position)
        if self.parts is None:
            total = sum(b - a for a, b in ranges)
            lo = total * part // self.ulysses
            hi = total * (part + 1) // self.ulysses
        else:
            lo = sum(self.parts[position * self.ulysses : member])
            hi = lo + self.parts[member]
        return _slice_ranges(ranges, lo, hi)

    def member_tokens(self, member: int) -> int:
        return sum(b - a for a, b in self.member_ranges(member))

    def member_token_counts(self) -> np.ndarray:
        """`member_tokens` of every member at once (R x U entries)."""
        if self.parts is not None:
            return np.asarray(self.parts, dtype=np.int64)
        u = self.ulysses
        positions = _slot_tokens([self], self.ring_size, self.layout).sum(axis=1)  # R
        cuts = positions[:, None] * np.arange(u + 1)[None, :] // u  # as `member_ranges` cuts
        return np.diff(cuts, axis=1).reshape(-1)


def _position_tokens(placements: list[SeqPlacement], ring: int) -> list[int]:
    """Tokens each of `ring` positions holds of `placements` together (one item's: they
    share its layout), `_slot_tokens` summed over the slots."""
    if ring == 1:
        return [sum(p.length for p in placements)]
    return _slot_tokens(placements, ring, placements[0].layout).sum(axis=1).tolist()


def _slot_tokens(placements: list[SeqPlacement], ring: int, layout: Layout) -> np.ndarray:
    """Tokens of each layout slot at each of `ring` positions (R x C), `placements`
    together (one item's: they share its layout)."""
    table = layout.chunk_table(ring)
    out = np.zeros((ring, layout.slots), dtype=np.int64)
    for p in placements:
        out += np.diff(np.asarray(p.bounds, dtype=np.int64))[table]
    return out


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in ranges:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def _slice_ranges(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Tokens lo..hi of the concatenation of `ranges`, as ranges."""
    out, seen = [], 0
    for a, b in ranges:
        start, end = max(a, a + lo - seen), min(b, a + hi - seen)
        if end > start:
            out.append((start, end))
        seen += b - a
    return out


def zone_of(ranks: tuple[int, ...], topology: Topology) -> Zone:
    if len(ranks) == 1:
        return Zone.LOCAL
    crosses = topology.node_of(min(ranks)) != topology.node_of(max(ranks))
    return Zone.INTER_NODE if crosses else Zone.INTRA_NODE


def link_kind(src: int, dst: int, topology: Topology) -> LinkKind:
    same = topology.node_of(src) == topology.node_of(dst)
    return LinkKind.INTRA_NODE if same else LinkKind.INTER_NODE


@dataclass(frozen=True)
class QueueItem:
    """Sequences that share a group: one ring (or all-gather) for all of them."""

    zone: Zone
    ranks: tuple[int, ...]
    ulysses: int
    exchange: Exchange
    seqs: tuple[int, ...]
    layout: Layout = ZIGZAG

    @property
    def ring_size(self) -> int:
        return len(self.ranks) // self.ulysses

    @property
    def exchange_kind(self) -> ExchangeKind:
        return EXCHANGES[self.exchange]

    def order_key(self) -> tuple:
        return (
            _ZONE_RANK[self.zone],
            self.ranks,
            self.ulysses,
            self.exchange.value,
            self.layout.name,
        )

    @property
    def owner_dkv(self) -> bool:
        """Under `parallel.dkv_wire=owner`, whether member u of position p sends step s's
        dK/dV straight to member u of position p - s (`options.DkvWire.OWNER`): a rotating
        item of several positions inside one node, or one with Ulysses members, whose
        members each send through their own links as their ring hops do."""
        if self.ring_size < 2 or not self.exchange_kind.rotates:
            return False
        return self.ulysses > 1 or self.zone is Zone.INTRA_NODE

    def owner_hops(self, step: int) -> list[tuple[int, int, int]]:
        """(position, sender, receiver) of step `step`'s dK/dV sent to their owners
        (`owner_dkv`): member u of position p sends to member u of position p - step."""
        ring, u_size, ranks = self.ring_size, self.ulysses, self.ranks
        return [
            (p, ranks[p * u_size + u], ranks[((p - step) % ring) * u_size + u])
            for p in range(ring)
            for u in range(u_size)
        ]

    def hops(self) -> list[tuple[int, int, int]]:
        """(position, sender, receiver) of every ring hop: member u of position p sends
        to member u of position p + 1, position-major."""
        ring, u_size, ranks = self.ring_size, self.ulysses, self.ranks
        return [
            (p, ranks[p * u_size + u], ranks[((p + 1) % ring) * u_size + u])
            for p in range(ring)
            for u in range(u_size)
        ]


@dataclass
class AttentionPlan:
    """Placement of one global batch.

    Attributes:
        planner: the placement whose planner made it.
        topology: the cluster it is for.
        tokens_per_rank: L, the hard token capacity of a rank.
        placements: one per sequence, `placements[i].seq == i` (unless sliced).
        planner_seconds: wall time of the planner.
        levels: the levels of work its planner tried and what each gave (zeppelin's work
            policy; empty for the others).
    """

    planner: Placement
    topology: Topology
    tokens_per_rank: int
    placements: tuple[SeqPlacement, ...]
    planner_seconds: float = 0.0
    sliced: bool = False
    """True for `slice_for`'s result, which holds only one rank's placements."""
    levels: tuple[LevelTry, ...] = field(default=(), compare=False)
    _items: list[QueueItem] | None = field(default=None, repr=False, compare=False)
    _by_seq: dict[int, SeqPlacement] | None = field(default=None, repr=False, compare=False)
    _rank_tokens: np.ndarray | None = field(default=None, repr=False, compare=False)
    _item_tokens: dict[QueueItem, list[int]] = field(default_factory=dict, repr=False,
                                                     compare=False)  # fmt: skip
    _item_slots: dict[QueueItem, Carried] = field(default_factory=dict, repr=False,
                                                  compare=False)  # fmt: skip
    """What each item's K/V messages carry (`carried`)."""
    _head_sums: dict = field(default_factory=dict, repr=False, compare=False)
    """`ray_zep.partition.stats`' sums over the Ulysses items, by model shape: plan_stats
    and the collective bytes both read them while a step is planned."""

    @property
    def world(self) -> int:
        return self.topology.world_size

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray([p.length for p in self.placements], dtype=np.int64)

    def placement(self, seq: int) -> SeqPlacement:
        """Placement of sequence `seq` (also in a slice, which keeps only some)."""
        if self._by_seq is None:
            self._by_seq = {p.seq: p for p in self.placements}
        return self._by_seq[seq]

    def slice_for(self, rank: int) -> AttentionPlan:
        """The part of the plan `rank` needs to execute: the placements of its groups."""
        mine = tuple(p for p in self.placements if rank in p.ranks)
        return AttentionPlan(
            self.planner,
            self.topology,
            self.tokens_per_rank,
            mine,
            self.planner_seconds,
            sliced=True,
        )

    def zone(self, seq: int) -> Zone:
        return zone_of(self.placement(seq).ranks, self.topology)

    def items(self) -> list[QueueItem]:
        """Every queue item of the batch, in execution order."""
        if self._items is None:
            groups: dict[tuple, list[int]] = {}
            for p in self.placements:
                key = (p.ranks, p.ulysses, p.exchange, p.layout)
                groups.setdefault(key, []).append(p.seq)
            items = [
                QueueItem(zone_of(ranks, self.topology), ranks, ulysses, exchange, tuple(seqs), lay)
                for (ranks, ulysses, exchange, lay), seqs in groups.items()
            ]
            self._items = sorted(items, key=QueueItem.order_key)
        return self._items

    def position_tokens(self, item: QueueItem) -> list[int]:
        """Tokens each ring position of `item` holds, its sequences together."""
        tokens = self._item_tokens.get(item)
        if tokens is None:
            tokens = _position_tokens([self.placement(s) for s in item.seqs], item.ring_size)
            self._item_tokens[item] = tokens
        return list(tokens)

    def carried_tokens(self, item: QueueItem, receivers, owners) -> np.ndarray:
        """Tokens that a ring message of `item` into each of `receivers` carries of the
        block of each of `owners` (arrays of positions, receiver != owner): the slots
        `Layout.carried_slots` names, its sequences together."""
        return self.carried(item).rows(receivers, owners)

    def carried(self, item: QueueItem) -> Carried:
        """The rows `item`'s K/V messages carry (`ray_zep.partition.carried`)."""
        carried = self._item_slots.get(item)
        if carried is None:
            slots = _slot_tokens([self.placement(s) for s in item.seqs], item.ring_size,
                                 item.layout)  # fmt: skip
            carried = self._item_slots[item] = Carried.of(slots, item.layout)
        return carried

    def rank_items(self, rank: int) -> list[QueueItem]:
        return [item for item in self.items() if rank in item.ranks]

    def layout(self, rank: int) -> list[Fragment]:
        """The rank's tokens in the order it holds them (item by item, sequence by sequence)."""
        fragments = []
        for item in self.rank_items(rank):
            member = item.ranks.index(rank)
            for seq in item.seqs:
                for a, b in self.placement(seq).member_ranges(member):
                    fragments.append(Fragment(seq, a, b, item.zone))
        return fragments

    def with_exchange(self, seqs: set[int], exchange: Exchange) -> AttentionPlan:
        """This plan with the sequences `seqs` exchanging by `exchange`; its token counts
        carried over, and its queue items where `seqs` are whole items (as `items()`
        would build them again: items left with the same group merge)."""
        placements = tuple(p._replace(exchange=exchange) if p.seq in seqs else p
                           for p in self.placements)  # fmt: skip
        out = AttentionPlan(self.planner, self.topology, self.tokens_per_rank, placements,
                            self.planner_seconds, self.sliced, self.levels)  # fmt: skip
        out._rank_tokens = self._rank_tokens
        out._item_tokens = dict(self._item_tokens)
        if self._items is None:
            return out
        merged: dict[tuple, list[QueueItem]] = {}
        for item in self._items:
            inside = [s in seqs for s in item.seqs]
            if any(inside) and not all(inside):
                return out  # a part of an item: its items are built again
            way = exchange if inside[0] else item.exchange
            key = (item.zone, item.ranks, item.ulysses, way, item.layout)
            merged.setdefault(key, []).append(item)
        items = [_merged_item(key, group) for key, group in merged.items()]
        out._items = sorted(items, key=QueueItem.order_key)
        return out

    def rank_tokens(self) -> np.ndarray:
        """Tokens held by every rank (a copy: the plan keeps its own)."""
        if self._rank_tokens is None:
            self._rank_tokens = self._count_rank_tokens()
        return self._rank_tokens.copy()

    def _count_rank_tokens(self) -> np.ndarray:
        counts = [0] * self.world
        wide = np.zeros(self.world, dtype=np.int64)  # the rings of more than `ARRAY_RING`
        for p in self.placements:
            if p.ulysses == 1 and p.layout is ZIGZAG:  # position r: chunks r and 2R-1-r
                b = p.bounds
                if len(p.ranks) == 1:  # a whole sequence: most of a batch's placements
                    counts[p.ranks[0]] += b[2] - b[0]
                    continue
                if len(p.ranks) > ARRAY_RING:
                    sizes = np.diff(np.asarray(b, dtype=np.int64))
                    wide[list(p.ranks)] += sizes[: len(p.ranks)] + sizes[len(p.ranks) :][::-1]
                    continue
                last = 2 * len(p.ranks) - 1
                for r, rank in enumerate(p.ranks):
                    counts[rank] += b[r + 1] - b[r] + b[last - r + 1] - b[last - r]
                continue
            for rank, held in zip(p.ranks, p.member_token_counts().tolist(), strict=True):
                counts[rank] += held
        return np.asarray(counts, dtype=np.int64) + wide

    def validate(self) -> None:
        """Check the plan's invariants.

        Raises:
            PlacementError: a sequence whose chunks do not tile it, a group that
                repeats or names an unknown rank, an all-gather that does not
                span the world, or a rank over its capacity L.
        """
        world = self.world
        for i, p in enumerate(self.placements):
            index = p.seq if self.sliced else i
            if not _is_plain_local(index, p, world):
                _check_placement(index, p, world)
        tokens = self.rank_tokens()
        over = np.flatnonzero(tokens > self.tokens_per_rank)
        if over.size:
            rank = int(over[0])
            raise PlacementError(
                f"{self.planner.value} placed {int(tokens[rank])} tokens on rank {rank}, "
                f"over train.tokens_per_rank={self.tokens_per_rank}"
            )


def _merged_item(key: tuple, group: list[QueueItem]) -> QueueItem:
    """The item of `key` (zone, ranks, U, exchange, layout) holding `group`'s sequences,
    ascending: the one item itself where it already is that (most of a batch's)."""
    zone, ranks, ulysses, way, layout = key
    if len(group) == 1 and group[0].exchange is way:
        seqs = group[0].seqs
        if len(seqs) == 1 or all(a < b for a, b in itertools.pairwise(seqs)):
            return group[0]
    seqs = tuple(sorted(s for item in group for s in item.seqs))
    return QueueItem(zone, ranks, ulysses, way, seqs, layout)


def _is_plain_local(index: int, p: SeqPlacement, world: int) -> bool:
    """Fast check of the common case: a valid whole sequence on one rank, no Ulysses."""
    if len(p.ranks) != 1 or p.ulysses != 1 or p.parts is not None or p.seq != index:
        return False
    bounds = p.bounds
    return (
        0 <= p.ranks[0] < world
        and p.length >= 1
        and len(bounds) == 3
        and bounds[0] == 0
        and 0 <= bounds[1] <= p.length
        and bounds[2] == p.length
        and (p.exchange is Exchange.RING or world == 1)
    )


def _check_placement(index: int, p: SeqPlacement, world: int) -> None:
    where = f"sequence {index} (length {p.length})"
    if p.seq != index or p.length < 1:
        raise PlacementError(f"{where}: placement is for sequence {p.seq} of length {p.length}")
    spread = p.ranks and not 0 <= min(p.ranks) <= max(p.ranks) < world
    if len(set(p.ranks)) != len(p.ranks) or spread:
        raise PlacementError(f"{where}: group {p.ranks} repeats or leaves ranks 0..{world - 1}")
    if p.ulysses < 1 or len(p.ranks) % p.ulysses:
        raise PlacementError(f"{where}: {len(p.ranks)} ranks are not a multiple of U={p.ulysses}")
    bounds = p.bounds
    if (
        len(bounds) != p.layout.chunks(p.ring_size) + 1
        or bounds[0] != 0
        or bounds[-1] != p.length
        or not all(map(operator.le, bounds, itertools.islice(bounds, 1, None)))
    ):
        raise PlacementError(
            f"{where}: chunk bounds {p.bounds} do not tile it in the "
            f"{p.layout.chunks(p.ring_size)} chunks of its {p.layout.name} layout"
        )
    if p.parts is not None:
        sums = [sum(p.parts[r * p.ulysses : (r + 1) * p.ulysses]) for r in range(p.ring_size)]
        expected = [p.position_tokens(r) for r in range(p.ring_size)]
        if len(p.parts) != len(p.ranks) or min(p.parts) < 0 or sums != expected:
            raise PlacementError(f"{where}: member parts {p.parts} do not split its positions")
    if EXCHANGES[p.exchange].spans_world and sorted(p.ranks) != list(range(world)):
        raise PlacementError(
            f"{where}: a group exchanging by {p.exchange.value} must span all {world} ranks"
        )


def even_bounds(length: int, ring_size: int) -> tuple[int, ...]:
    """2R + 1 offsets cutting `length` tokens into 2R zigzag chunks within one token."""
    return ZIGZAG.even_bounds(length, ring_size)


def peer_tokens(positions, ulysses: int) -> np.ndarray:
    """Per member of a group (ring-position major), the tokens of the other ring positions
    (`positions`: each position's tokens), over its U Ulysses members: the K/V a member
    of a kept ring holds from its peers (`Exchange.RING_KEPT`), in token rows of every
    K/V head."""
    positions = np.asarray(positions, dtype=np.float64)
    return np.repeat(positions.sum() - positions, ulysses) / ulysses


def bounds_for_counts(counts: list[int]) -> tuple[int, ...]:
    """Zigzag offsets giving ring position r exactly `counts[r]` tokens (any counts >= 0).

    Position r takes floor(counts[r] / 2) tokens in its early chunk and the rest
    in its late chunk.
    """
    return ZIGZAG.bounds_for_counts(counts)


def local_placement(seq: int, length: int, rank: int) -> SeqPlacement:
    """A whole sequence on one rank."""
    # `even_bounds(length, 1)` spelled out: planners build tens of thousands per batch
    return SeqPlacement(seq, length, (rank,), (0, length // 2, length))
