"""A rank's execution metadata for one batch, built once on the host from the plan.

Every layer reuses it: the engine never loops over documents to find boundaries
and never reads sizes back from the device.

Terms (see `ray_zep.partition.plan`): a queue item's ring position r holds, per
sequence, the chunks its layout gives it (the *position layout*); Ulysses member u
holds a contiguous part of it (the *member layout*, which is this rank's rows).
At ring step s position r computes its queries against the K and V of position
(r - s) mod R: step 0 causal over each sequence's own chunks, later steps the one
unmasked block per sequence the layout selects (`ray_zep.partition.layout`).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from ray_zep.attention.varlen import PackedSeqs
from ray_zep.partition.exchange import Play
from ray_zep.partition.layout import ZIGZAG
from ray_zep.partition.plan import AttentionPlan, QueueItem
from ray_zep.routing.routes import Phase, RankRouting


@dataclass(frozen=True)
class StepMeta:
    """One ring step: which query and key rows meet, as packed varlen segments."""

    source: int
    """Ring position whose K and V this step uses."""
    q_rows: torch.Tensor
    """int64 rows of the position layout, segment after segment."""
    k_rows: torch.Tensor
    """int64 rows of the source's position layout."""
    seqs_q: PackedSeqs
    seqs_k: PackedSeqs
    causal: bool
    q_span: slice | None = None
    """`q_rows` as one run of rows, when they are one (no rows to gather)."""
    k_span: slice | None = None
    """`k_rows` as one run of rows, when they are one."""

    @property
    def empty(self) -> bool:
        return self.q_rows.numel() == 0

    @property
    def query_rows(self) -> torch.Tensor | slice:
        """The queries' rows: the run where they are one (a view, nothing copied)."""
        return self.q_span if self.q_span is not None else self.q_rows

    @property
    def key_rows(self) -> torch.Tensor | slice:
        """The keys' rows: the run where they are one."""
        return self.k_span if self.k_span is not None else self.k_rows

    @classmethod
    def of_segments(
        cls, source: int, segments: list, causal: bool, device: torch.device | str = "cpu"
    ) -> StepMeta:
        """The step of (q_offset, q_len, k_offset, k_len) segments (`step_segments`)."""
        q = [(seg[0], seg[1]) for seg in segments]
        k = [(seg[2], seg[3]) for seg in segments]
        return cls(
            source=source,
            q_rows=_rows(q, device),
            k_rows=_rows(k, device),
            seqs_q=PackedSeqs.from_lengths([n for _, n in q], device),
            seqs_k=PackedSeqs.from_lengths([n for _, n in k], device),
            causal=causal,
            q_span=_run(q),
            k_span=_run(k),
        )


def _rows(runs: list[tuple[int, int]], device) -> torch.Tensor:
    parts = [np.arange(start, start + length) for start, length in runs]
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return torch.as_tensor(flat, dtype=torch.int64, device=device)


def _run(runs: list[tuple[int, int]]) -> slice | None:
    """The runs as one slice where each starts where the one before ends."""
    if not runs or any(a + n != b for (a, n), (b, _) in itertools.pairwise(runs)):
        return None
    return slice(runs[0][0], runs[-1][0] + runs[-1][1])


@dataclass(frozen=True)
class ItemSchedule:
    """What this rank does for one queue item.

    Attributes:
        item: the queue item.
        rows: this rank's rows of the item, [start, stop) in its layout.
        position: this rank's ring position r.
        part: this rank's Ulysses member index u.
        position_tokens: tokens of every ring position (buffer sizes).
        member_tokens: tokens of every member of this rank's position.
        gather_order: position-layout row of each row received in the Ulysses
            exchange (member after member); identity when U = 1.
        ring_next, ring_prev: ranks this position sends to and receives from.
        steps: the R ring steps.
    """

    item: QueueItem
    rows: tuple[int, int]
    position: int
    part: int
    position_tokens: tuple[int, ...]
    member_tokens: tuple[int, ...]
    gather_order: torch.Tensor
    ring_next: int
    ring_prev: int
    steps: tuple[StepMeta, ...]

    @property
    def play(self) -> Play:
        """How the engine runs the item's exchange (`ExchangeKind.play_for`)."""
        return self.item.exchange_kind.play_for(self.item.ring_size)

    @property
    def keeps_kv(self) -> bool:
        """The forward keeps the K/V it receives; the backward sends none
        (`ExchangeKind.keeps_kv`)."""
        return self.item.exchange_kind.keeps_kv and len(self.steps) > 1

    @property
    def ulysses_peers(self) -> tuple[int, ...]:
        u = self.item.ulysses
        return self.item.ranks[self.position * u : (self.position + 1) * u]


@dataclass
class RankSchedule:
    """All queue items of one rank for one batch, in execution order.

    Attributes:
        rank: the rank.
        tokens: rows of the rank's layout (inputs may carry padding rows after them).
        items: per-item schedules.
        ops: tally of communication calls issued (`p2p` direct, `routed` through
            proxies, `all_gather`, `reduce_scatter`), for tests and metrics.
        routing: the routed transfers this rank sends, receives or relays (None:
            every transfer is direct).
    """

    rank: int
    tokens: int
    items: list[ItemSchedule]
    ops: Counter = field(default_factory=Counter)
    routing: RankRouting | None = None
    routes: dict = field(default_factory=dict)
    """Route of each routed transfer this rank sends or receives, by `Transfer.lookup_key`."""
    relayed: dict = field(default_factory=dict)
    """Per phase, the transfers this rank's relay thread forwards (every layer reuses it)."""

    @classmethod
    def build(
        cls,
        plan: AttentionPlan,
        rank: int,
        device: torch.device | str = "cpu",
        routing: RankRouting | None = None,
    ) -> RankSchedule:
        items, start = [], 0
        for item in plan.rank_items(rank):
            schedule = _item_schedule(plan, item, rank, start, device)
            items.append(schedule)
            start = schedule.rows[1]
        if routing is None:
            return cls(rank, start, items)
        relayed = {phase: routing.relayed(phase) for phase in Phase}
        return cls(rank, start, items, routing=routing, routes=routing.routes(), relayed=relayed)


def position_layout(plan: AttentionPlan, item: QueueItem, position: int):
    """Per sequence of the item: the tokens of each layout slot at `position`."""
    return [plan.placement(seq).slot_tokens(position) for seq in item.seqs]


def item_layouts(plan: AttentionPlan, item: QueueItem) -> np.ndarray:
    """`position_layout` at every ring position of the item at once (positions x
    sequences x slots), on arrays (`Layout.slot_sizes`): a ring of a thousand positions
    over hundreds of sequences would take a Python call per pair."""
    ring, count, layout = item.ring_size, len(item.seqs), item.layout
    bounds = itertools.chain.from_iterable(plan.placement(seq).bounds for seq in item.seqs)
    flat = np.fromiter(bounds, np.int64)
    first = np.repeat(np.arange(count) * (layout.chunks(ring) + 1), ring)  # sequence-major
    sizes = layout.slot_sizes(flat, first, ring, np.tile(np.arange(ring), count))
    return sizes.reshape(count, ring, layout.slots).transpose(1, 0, 2)


def _item_schedule(
    plan: AttentionPlan, item: QueueItem, rank: int, start: int, device
) -> ItemSchedule:
    member = item.ranks.index(rank)
    u_size, ring = item.ulysses, item.ring_size
    position, part = divmod(member, u_size)
    layouts = [position_layout(plan, item, r) for r in range(ring)]
    position_tokens = tuple(sum(sum(slots) for slots in lay) for lay in layouts)
    placements = [plan.placement(s) for s in item.seqs]
    members = range(position * u_size, (position + 1) * u_size)
    member_tokens = tuple(sum(p.member_tokens(m) for p in placements) for m in members)
    gather = _gather_order(placements, position, members)
    steps = tuple(
        _step_meta(
            layouts[position],
            layouts[(position - s) % ring],
            s,
            (position - s) % ring,
            position,
            item.layout,
            device,
        )
        for s in range(ring)
    )
    return ItemSchedule(
        item=item,
        rows=(start, start + member_tokens[part]),
        position=position,
        part=part,
        position_tokens=position_tokens,
        member_tokens=member_tokens,
        gather_order=torch.as_tensor(gather, dtype=torch.int64, device=device),
        ring_next=item.ranks[((position + 1) % ring) * u_size + part],
        ring_prev=item.ranks[((position - 1) % ring) * u_size + part],
        steps=steps,
    )


def _gather_order(placements, position: int, members: range) -> np.ndarray:
    """Position-layout row of each row of the member layouts, members concatenated."""
    seq_start = np.cumsum([0] + [p.position_tokens(position) for p in placements])
    order = []
    for m in members:
        for i, p in enumerate(placements):
            ranges = p.position_ranges(position)
            for a, b in p.member_ranges(m):
                order.append(_rows_in_position(ranges, a, b) + seq_start[i])
    return np.concatenate(order) if order else np.zeros(0, dtype=np.int64)


def _rows_in_position(ranges: list[tuple[int, int]], a: int, b: int) -> np.ndarray:
    """Offsets within the position's concatenated ranges of sequence tokens [a, b)."""
    seen = 0
    for lo, hi in ranges:
        if lo <= a < hi:
            return np.arange(a - lo, b - lo, dtype=np.int64) + seen
        seen += hi - lo
    raise ValueError(f"tokens [{a}, {b}) are not at this position")


def step_segments(mine, theirs, step: int, source: int, position: int, layout=ZIGZAG) -> list:
    """The (q_offset, q_len, k_offset, k_len) segments ring step `step` computes.

    `mine` and `theirs` are the slot token counts per sequence of this position and
    of the source position; each sequence's block is its layout's (`Layout.block`);
    empty segments are left out. The engine builds its row indices from these and the
    simulator costs them, so both see the same work.
    """
    segments = []
    q_off = k_off = 0
    for slots, src_slots in zip(mine, theirs, strict=True):
        block = layout.block(slots, src_slots, step, source < position)
        if block is not None and block[1] > 0 and block[3] > 0:
            segments.append((q_off + block[0], block[1], k_off + block[2], block[3]))
        q_off += sum(slots)
        k_off += sum(src_slots)
    return segments


def _step_meta(mine, theirs, step: int, source: int, position: int, layout, device) -> StepMeta:
    segments = step_segments(mine, theirs, step, source, position, layout)
    return StepMeta.of_segments(source, segments, step == 0, device)


def expected_ops(
    plan: AttentionPlan, rank: int, routing: RankRouting | None = None, dkv_owner: bool = False
) -> Counter:
    """Communication calls one forward and backward of a layer issue on `rank`'s main thread.

    Each item's exchange kind issues its `ExchangeKind.calls_per_layer` (`dkv_owner`:
    `parallel.dkv_wire=owner`, where the item sends dK/dV to their owners). Ulysses:
    four exchanges (Q/K/V and output forward, their gradients backward) of U - 1
    sends and receives each. A routed send or receive replaces one `p2p` by the
    `routed` messages of its route.
    """
    ops: Counter = Counter()
    for item in plan.rank_items(rank):
        u_size = item.ulysses
        ops.update(item.exchange_kind.calls_per_layer(item.ring_size, dkv_owner and item.owner_dkv))
        if u_size > 1:
            ops["p2p"] += 4 * 2 * (u_size - 1)
    for t in (routing.forward + routing.backward) if routing else ():
        if t.route.src == rank:
            ops["p2p"] -= 1
            ops["routed"] += t.route.source_messages()
        if t.route.dst == rank:
            ops["p2p"] -= 1
            ops["routed"] += t.route.destination_messages()
    return +ops
