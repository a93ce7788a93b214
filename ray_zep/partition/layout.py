"""Chunk layouts: how a group of R ring positions cuts a sequence and what each step computes.

A layout cuts a sequence into R x C chunks (C `slots` per position) at R x C + 1
offsets (`SeqPlacement.bounds`) and gives ring position r the chunks
`chunk_index(R, r, slot)` for slot 0 .. C-1, in rising token order. Position r holds
those chunks one after the other (its *position layout*). At ring step s it computes
its queries against the K and V of source position j = (r - s) mod R:

- step 0 (j = r): its own tokens, causal over their concatenation;
- j before r: the query slots `before[0]` against the source's key slots `before[1]`,
  no mask;
- j after r: `after[0]` against `after[1]`, no mask (None: nothing).

Each selection is a run of consecutive slots, so a step is one (query range, key
range) block per sequence, which a varlen kernel call takes as one segment. The
blocks of all steps together must be exactly the causal (query, key) pairs of the
sequence: `causal_pairs_match` checks a layout for that (the tests run it on every
registered one). The planner, the engine's schedule (`ray_zep.attention.schedule`),
the plan statistics (`member_arrays`), the work model and the simulator
(`ray_zep.sim.step_costs`, `ray_zep.sim.program`) all read the layout; none of them
knows how a layout cuts.

Trimmed messages. A block travels the ring from its owner j to j + 1, j + 2, ...:
first the receivers after j (they select `before`'s key slots), then, once its message
has passed from position R - 1 to 0, those before j (`after`'s). A message carries only
the slots that its receiver and the receivers still ahead of it select
(`Layout.carried_slots`) where the layout `trims`: `MirroredZigzag` halves every message
after the wrap. The engine sends those rows, the steps index them, and routing, the
simulator and the byte counts read the same slots. Zigzag does not trim: Transformer
Engine and PyTorch send whole blocks, and the baselines run as they do.

Adding a chunking is one subclass with `name`, `slots`, `before`, `after` and a
vectorised `chunk_index`, registered with `register_layout` (PyTorch's context
parallelism likewise keeps one load-balancer class per chunking).

Shapes: R positions, S sequences, C slots.
"""

from __future__ import annotations

import itertools
from functools import cached_property
from typing import ClassVar

import numpy as np

from ray_zep.errors import PlacementError

Slots = tuple[int, ...]


class Layout:
    """One chunking of a sequence over the positions of a ring (module docstring)."""

    name: ClassVar[str]
    slots: ClassVar[int]
    """C: chunks each position holds."""
    before: ClassVar[tuple[Slots, Slots]]
    """(query slots, key slots) a position computes against a source before it."""
    after: ClassVar[tuple[Slots, Slots] | None]
    """The same against a source after it; None: such steps compute nothing."""
    trims: ClassVar[bool] = False
    """Ring messages carry only the slots their receivers select (`carried_slots`); off,
    whole blocks, as the systems whose layout it is send them."""

    def chunk_index(self, ring, position, slot):
        """Index of the chunk that `position` of a ring of `ring` holds in `slot`
        (element-wise over numpy arrays)."""
        raise NotImplementedError

    def __reduce__(self):
        return layout_named, (self.name,)

    def __repr__(self) -> str:
        return f"Layout({self.name})"

    # scalar form: the planner and the engine's schedule

    def chunks(self, ring: int) -> int:
        """Chunks of a sequence on a ring of `ring` positions."""
        return ring * self.slots

    def position_chunks(self, ring: int, position: int) -> list[int]:
        return [int(self.chunk_index(ring, position, s)) for s in range(self.slots)]

    def split(self, tokens: int) -> list[int]:
        """Tokens of each slot when a position holds `tokens` (later slots take the
        remainder)."""
        c = self.slots
        return [tokens * (i + 1) // c - tokens * i // c for i in range(c)]

    def bounds_for_counts(self, counts) -> tuple[int, ...]:
        """Chunk offsets giving ring position r exactly `counts[r]` tokens (any >= 0)."""
        ring = len(counts)
        sizes = [0] * self.chunks(ring)
        for r, n in enumerate(counts):
            for slot, part in enumerate(self.split(int(n))):
                sizes[self.chunk_index(ring, r, slot)] = part
        return (0, *itertools.accumulate(sizes))

    def even_bounds(self, length: int, ring: int) -> tuple[int, ...]:
        """Offsets cutting `length` tokens into the ring's chunks within one token."""
        chunks = self.chunks(ring)
        return tuple(length * c // chunks for c in range(chunks + 1))

    def block(self, mine: Slots, theirs: Slots, step: int, before: bool):
        """The block a step computes for one sequence: (q offset, q tokens, k offset,
        k tokens) within the two positions' layouts, from the slot token counts of this
        position (`mine`) and of the source (`theirs`); None when it computes nothing.
        Step 0 is causal, every other step unmasked."""
        if step == 0:
            return 0, sum(mine), 0, sum(theirs)
        selection = self.before if before else self.after
        if selection is None:
            return None
        q_slots, k_slots = selection
        return (*_run(mine, q_slots), *_run(theirs, k_slots))

    def carried_slots(self, ring: int, receiver: int, owner: int) -> tuple[int, ...]:
        """Slots of `owner`'s block that a ring message into `receiver` carries: those
        that it and the receivers after it select, up to the owner (module docstring:
        `Trimmed messages`); none past the last that selects any."""
        mask = self.carried_mask(np.asarray(receiver), np.asarray(owner))
        return tuple(int(slot) for slot in np.flatnonzero(mask))

    def carried_mask(self, receiver: np.ndarray, owner: np.ndarray) -> np.ndarray:
        """`carried_slots` as a boolean mask over the slots (shape: the arrays' broadcast
        shape x C), element-wise over receiver and owner positions (receiver != owner)."""
        shape = (*np.broadcast_shapes(np.shape(receiver), np.shape(owner)), self.slots)
        if not self.trims:
            return np.ones(shape, dtype=bool)
        before, after = (np.zeros(self.slots, dtype=bool) for _ in range(2))
        before[list(self.before[1])] = True
        if self.after is not None:
            after[list(self.after[1])] = True
        unwrapped = (np.asarray(receiver) > np.asarray(owner))[..., None]
        later = (np.asarray(owner) > 0)[..., None]  # some receivers before the owner remain
        return np.broadcast_to(np.where(unwrapped, before | (after & later), after), shape)

    @cached_property
    def kind_masks(self) -> np.ndarray:
        """`carried_mask` of the three kinds of message `ray_zep.partition.carried` sums
        (a receiver after owner 0; after a later owner; before its owner), 3 x C, worked
        out once per layout."""
        pairs = ((1, 0), (2, 1), (0, 1))
        masks = np.stack([self.carried_mask(np.asarray(r), np.asarray(o)) for r, o in pairs])
        return masks.astype(np.int64)

    def chunk_table(self, ring: int) -> np.ndarray:
        """`chunk_index` of every position and slot of a ring of `ring` (R x C), worked
        out once per ring size (read-only)."""
        tables = self.__dict__.setdefault("_chunk_tables", {})
        table = tables.get(ring)
        if table is None:
            positions = np.arange(ring)
            table = np.stack([self.chunk_index(ring, positions, s)
                              for s in range(self.slots)], axis=1).astype(np.int64)  # fmt: skip
            table.flags.writeable = False
            tables[ring] = table
        return table

    # array form: the plan statistics, the work model and the simulator

    def slot_sizes(self, bounds: np.ndarray, first: np.ndarray, ring, position) -> np.ndarray:
        """Tokens of every slot (rows x C) of rows (one sequence at one position each):
        `bounds` holds every sequence's offsets, `first` each row's first offset there."""
        out = np.zeros((np.size(position), self.slots), dtype=np.int64)
        for slot in range(self.slots):
            at = first + self.chunk_index(ring, position, slot)
            out[:, slot] = bounds[at + 1] - bounds[at]
        return out

    def selected(self, sizes_RSC: np.ndarray, before: bool, keys: bool) -> np.ndarray:
        """Tokens of the slots a later step selects (R x S): query slots, or key slots
        with `keys`, of steps against a source before (or after) the position."""
        selection = self.before if before else self.after
        if selection is None:
            return np.zeros(sizes_RSC.shape[:2], dtype=sizes_RSC.dtype)
        return sizes_RSC[:, :, list(selection[int(keys)])].sum(axis=2)

    def busiest_member_blocks(self, share):
        """(diagonal pairs, diagonal block length, later-step pairs, later-step block
        length) of the busiest member of a ring whose members hold `share` tokens each
        of a sequence, split evenly over its slots: the work model's ring member."""
        c = np.asarray(share, dtype=np.float64)
        slot = c / self.slots
        q_before, k_before = (len(s) * slot for s in self.before)
        pairs, length = q_before * k_before, np.sqrt(q_before * k_before)
        if self.after is not None:
            q_after, k_after = (len(s) * slot for s in self.after)
            later = q_after * k_after
            length = np.where(later > pairs, np.sqrt(q_after * k_after), length)
            pairs = np.maximum(pairs, later)
        return c * c / 2, c, pairs, length


def _run(sizes: Slots, slots: Slots) -> tuple[int, int]:
    """(offset, tokens) of the consecutive `slots` within a position's layout."""
    return sum(sizes[: slots[0]]), sum(sizes[s] for s in slots)


ARRAY_RING = 64
"""Ring positions past which the zigzag layout's planners' helpers work on arrays (te_cp's,
llama_cp's and usp's rings of every rank); below it Python's loops cost less."""


class Zigzag(Layout):
    """2R chunks; position r holds chunks r and 2R-1-r, which balances causal work
    (Transformer Engine's and PyTorch's head-tail load balancing). Against an earlier
    source all its rows meet the source's early chunk; against a later one its late
    chunk meets all the source's rows."""

    name = "zigzag"
    slots = 2
    before = ((0, 1), (0,))
    after = ((1,), (0, 1))

    def chunk_index(self, ring, position, slot):
        return np.where(np.asarray(slot) == 0, position, 2 * np.asarray(ring) - 1 - position)

    # the generic forms, spelled out: planners call these for thousands of sequences

    def position_chunks(self, ring: int, position: int) -> list[int]:
        return [position, 2 * ring - 1 - position]

    def bounds_for_counts(self, counts) -> tuple[int, ...]:
        """Each position's first chunk takes half its tokens, its second the rest (a
        subclass that moves the chunks, `position_chunks` and `chunk_index`, keeps this)."""
        ring = len(counts)
        if ring > ARRAY_RING:  # one ring of every rank: the same offsets on arrays
            held = np.asarray(counts, dtype=np.int64)
            positions = np.arange(ring)
            sizes = np.zeros(2 * ring, dtype=np.int64)
            sizes[self.chunk_index(ring, positions, 0)] = held // 2
            sizes[self.chunk_index(ring, positions, 1)] = held - held // 2
            return (0, *np.cumsum(sizes).tolist())
        sizes = [0] * (2 * ring)
        for r, n in enumerate(counts):
            first, second = self.position_chunks(ring, r)
            sizes[first] = n // 2
            sizes[second] = n - n // 2
        return (0, *itertools.accumulate(sizes))

    def busiest_member_blocks(self, share):
        c = np.asarray(share, dtype=np.float64)
        return c * c / 2, c, c * c / 2, c / 2


ZIGZAG = Zigzag()


class MirroredZigzag(Zigzag):
    """Zigzag with the positions' order reversed: position r holds chunks R-1-r and R+r.
    A block then meets the receivers that need all of it first and, once its message
    has passed from the last position to the first, only receivers that need its early
    chunk, so every message after that carries half the block (`carried_slots`); the
    first position receives nothing but halves. The work per step is zigzag's."""

    name = "mirrored_zigzag"
    before = ((1,), (0, 1))
    after = ((0, 1), (0,))
    trims = True

    def chunk_index(self, ring, position, slot):
        ring, position = np.asarray(ring), np.asarray(position)
        return np.where(np.asarray(slot) == 0, ring - 1 - position, ring + position)

    def position_chunks(self, ring: int, position: int) -> list[int]:
        return [ring - 1 - position, ring + position]


MIRRORED_ZIGZAG = MirroredZigzag()

LAYOUTS: dict[str, Layout] = {}
"""Every registered layout by name."""


def register_layout(layout: Layout) -> Layout:
    """Add `layout` to `LAYOUTS` (plans name their layout; processes find it by name).

    Raises:
        PlacementError: another layout has its name, or a selection is not a run of
            consecutive slots.
    """
    known = LAYOUTS.get(layout.name)
    if known is not None and type(known) is not type(layout):
        raise PlacementError(f"layout {layout.name!r} is registered already")
    for selection in (layout.before, layout.after or ((0,), (0,))):
        for slots in selection:
            if not slots or list(slots) != list(range(slots[0], slots[0] + len(slots))):
                raise PlacementError(
                    f"layout {layout.name!r}: slots {slots} are not a run of consecutive slots"
                )
    LAYOUTS.setdefault(layout.name, layout)
    return LAYOUTS[layout.name]


def layout_named(name: str) -> Layout:
    """The registered layout `name`.

    Raises:
        PlacementError: no layout has that name.
    """
    if name not in LAYOUTS:
        raise PlacementError(f"no layout named {name!r}; known: {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


register_layout(ZIGZAG)
register_layout(MIRRORED_ZIGZAG)


def causal_pairs_match(layout: Layout, ring: int, bounds: tuple[int, ...]) -> bool:
    """Whether the blocks of every step of every position of a ring cover each causal
    (query, key) pair of a sequence cut at `bounds` exactly once (a layout's check)."""
    length = bounds[-1]
    seen = np.zeros((length, length), dtype=np.int64)
    tokens = []
    for r in range(ring):
        chunks = layout.position_chunks(ring, r)
        if chunks != sorted(chunks):
            return False
        tokens.append(np.concatenate([np.arange(bounds[c], bounds[c + 1]) for c in chunks]))
    for r, s in itertools.product(range(ring), range(ring)):
        j = (r - s) % ring
        sizes = [[bounds[c + 1] - bounds[c] for c in layout.position_chunks(ring, p)]
                 for p in (r, j)]  # fmt: skip
        block = layout.block(tuple(sizes[0]), tuple(sizes[1]), s, j < r)
        if block is None or block[1] == 0 or block[3] == 0:
            continue
        q = tokens[r][block[0] : block[0] + block[1]]
        k = tokens[j][block[2] : block[2] + block[3]]
        keep = k[None, :] <= q[:, None] if s == 0 else np.ones((q.size, k.size), dtype=bool)
        np.add.at(seen, (np.broadcast_to(q[:, None], keep.shape)[keep],
                         np.broadcast_to(k[None, :], keep.shape)[keep]), 1)  # fmt: skip
    return bool(np.array_equal(seen, np.tril(np.ones((length, length), dtype=np.int64))))
