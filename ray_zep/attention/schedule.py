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
        trimmed: what each step's K/V message carries (`Trimmed`).
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
    trimmed: Trimmed | None = None
    """None: every message carries whole blocks (one position, a gathering play, or a
    layout that does not trim)."""

    def held_rows(self, step: int) -> int:
        """Rows of the K/V block this position holds at `step`."""
        if self.trimmed is None:
            return self.position_tokens[self.steps[step].source]
        return self.trimmed.held[step]

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


@dataclass(frozen=True)
class Trimmed:
    """The rows of one position's K/V messages, where a message carries only the layout
    slots its receiver and the receivers after it select (`Layout.carried_slots`).
    Per step s (index s): the block's rows this position holds, and `None` wherever
    that is the whole of it or of what it has."""

    held: tuple[int, ...]
    """Rows of the block held at step s (the position's own at step 0)."""
    expand: tuple[torch.Tensor | None, ...]
    """Rows of the source's position layout that the held block's rows are."""
    send: tuple[torch.Tensor | None, ...]
    """Rows of the held block sent on to the next position after step s."""
    returned: tuple[torch.Tensor | None, ...]
    """Rows of this position's own block that position p + s held at its step s (what
    it sends back under the owner dK/dV wire); index 0 unused."""


def _held_masks(position: int, ring: int, layout) -> list[np.ndarray]:
    """Per step, the layout slots of the block `position` holds then: its own whole at step
    0, afterwards what its message carried (`Layout.carried_slots`)."""
    owners = (position - np.arange(ring)) % ring
    masks = list(layout.carried_mask(np.asarray(position), owners))
    masks[0] = np.ones(layout.slots, dtype=bool)
    return masks


def _trimmed(layouts, position: int, masks, layout, device) -> Trimmed:
    """The trimmed rows of `position`'s messages (`Trimmed`); `layouts`: every
    position's slot tokens per sequence; `masks`: `_held_masks`."""
    ring = len(layouts)
    whole = masks[0]

    def carried(receiver: int, owner: int) -> np.ndarray:
        return layout.carried_mask(np.asarray(receiver), np.asarray(owner))

    held, expand, send, returned = [], [], [], []
    for s, mask in enumerate(masks):
        owner = (position - s) % ring
        sizes = layouts[owner]
        held.append(int(sum(np.asarray(slots) @ mask for slots in sizes)))
        expand.append(_rows_of(sizes, whole, mask, device))
        following = (position + 1) % ring
        on = carried(following, owner) if following != owner else mask
        send.append(_rows_of(sizes, mask, on, device))
        back = carried((position + s) % ring, position) if s else whole
        returned.append(_rows_of(layouts[position], whole, back, device))
    return Trimmed(tuple(held), tuple(expand), tuple(send), tuple(returned))


def _rows_of(sizes, held: np.ndarray, kept: np.ndarray, device) -> torch.Tensor | None:
    """Rows, within a block holding the slots `held` of sequences of slot token counts
    `sizes`, of the slots `kept` (a subset); None where that is all of them."""
    if np.array_equal(held, kept):
        return None
    runs, start = [], 0
    for slots in sizes:
        for n, has, keep in zip(slots, held, kept, strict=True):
            if has:
                if keep and n:
                    runs.append((start, int(n)))
                start += int(n)
    return _rows(runs, device)


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
    # messages carry part of a block only where a rotating exchange's layout trims them
    trims = item.exchange_kind.rotates and ring > 1 and item.layout.trims
    held = [layouts[(position - s) % ring] for s in range(ring)]
    trimmed = None
    if trims:
        masks = _held_masks(position, ring, item.layout)
        trimmed = _trimmed(layouts, position, masks, item.layout, device)
        held = [_carried_layout(sizes, mask) for sizes, mask in zip(held, masks, strict=True)]
    steps = tuple(
        _step_meta(
            layouts[position],
            held[s],
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
        trimmed=trimmed,
    )


def _carried_layout(sizes, mask: np.ndarray):
    """A source's slot tokens per sequence (`sizes`) as the block held has them (`mask`,
    `_held_masks`): the slots its message did not carry count no tokens, so that the
    step's key offsets index the rows received."""
    return [tuple(n if keep else 0 for n, keep in zip(slots, mask, strict=True))
            for slots in sizes]  # fmt: skip


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
