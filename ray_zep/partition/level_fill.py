"""Step 3 of a level's placement (`ray_zep.partition.balance`): the rank loads a level
builds, the whole sequences after its rings, best fit decreasing under the level within
token room, the small rings inside a node for those that fit under it nowhere (on ranks in
no ring, else on members of one ring: `ray_zep.partition.co_rings`), and the
spills of those no rank has token room for; and the rings' shared chunks and the room a
ring keeps for its peers' K/V."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ray_zep.partition.co_rings import RingLabels, co_member_ring
from ray_zep.partition.fill import water_fill
from ray_zep.partition.fill_kernel import (
    GIVEN_UP,
    HOPELESS,
    KEPT,
    NEXT_LABEL,
    POSITION,
    RECORDED,
    RING_HEAD,
    SECOND,
    SPILL,
    deal,
)
from ray_zep.partition.index_kernel import move
from ray_zep.partition.load_index import new_index
from ray_zep.partition.ring_search_kernel import spare_ring
from ray_zep.partition.work import WorkModel
from ray_zep.topology import Topology

SMALL_RING_SHARE = 0.15
"""A whole sequence that fits under the level nowhere becomes a small ring only when
its work is at least this share of the level (a shorter one overshoots by little).
0.15 against 0.25 (bench scale at 4k tokens per GPU): 7b chat at 64 GPUs steps 1.1453 ->
1.1244 of its bound and 13b chat at 1,024 1.1234 -> 1.1144, 7b chat at 4,096 1.1024 ->
1.1033, the other rows as before; 0.1 and 0.2 step the 24 rows at 64-1,024 GPUs slower."""
SPILL_CANDIDATES = 64
"""Ranks with most free tokens sorted first when a sequence spills (all, if they lack room)."""
SECOND_RING_ABOVE = 0.05
"""A whole sequence that fits under the level nowhere becomes a second ring on members
of one ring (`ray_zep.partition.co_rings`) only where the least loaded rank taking it
whole would end the busiest rank so far and more than this share over the level. On
`bench scale`'s batches 0 made 446 second rings on 13b chat at 1,024 GPUs, at levels
that a higher one beats anyway, for 12 ms more `plan_step`; 0.05 keeps every row's gain
of 0; 0.1 loses 13b github's at 1,024 GPUs, 0.2 the 256-GPU chat rows' too."""
SECOND_RINGS = True
"""Whole sequences that fit under the level nowhere may ride as second rings on members of
one ring (`ray_zep.partition.co_rings`)."""
CHECK_EVERY = 256
"""Sequences the whole-sequence fill deals between two checks that its level can still
win (`fill_kernel.hopeless`: a pass over the ranks); 0: none."""


@dataclass
class Placed:
    """One level's placement: every sequence's ranks and member token counts."""

    load: np.ndarray
    """Modelled work of every rank, seconds."""
    tokens: np.ndarray
    in_ring: np.ndarray
    """Ranks already in a ring: a rank joins at most one, so that every ring starts
    at once on all its members (the engine runs a rank's rings one after another,
    and a second ring would wait for the members' first ones); only a hosted ring
    (`ray_zep.partition.hosting`) or a small ring over members of one ring inside a node
    (`ray_zep.partition.co_rings`), whose members all end that ring together, is a
    second one."""
    groups: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    """Ring sequences: seq -> (ranks ascending, tokens of each)."""
    ulysses: dict[int, int] = field(default_factory=dict)
    """Ring sequences whose ring positions are whole nodes exchanging heads: seq -> U."""
    local: dict[int, int] = field(default_factory=dict)
    """Whole sequences: seq -> rank."""
    kept_rings: set[tuple[int, ...]] = field(default_factory=set)
    """Rings (their ranks) that keep their K/V beyond the work model's budget, in token
    room their members leave free (`kept_room`)."""
    resent: set[tuple[int, ...]] = field(default_factory=set)
    """Rings (their ranks) that send their K/V again in the backward whatever the budget:
    rings hosted on ranks whose host ring already counts on the budget
    (`ray_zep.partition.hosting`)."""
    pruned: bool = False
    """Abandoned once a rank's work reached its bound (`prune_above`): the busiest rank of
    a placement made before it, where it can only end as busy or busier (on a tie the
    earlier one is kept), so it is never chosen; or a lower bound the level scan sets
    (`ray_zep.partition.level_scan`)."""
    given_up: bool = False
    """The fill stopped where the sequences left must bring a rank to the bound
    (`fill_kernel.hopeless`)."""
    dealt: int = 0
    """Whole sequences the fill went through: all, or those before the one it stopped at."""
    fill_fits: bool = False
    """The whole sequences fit the tokens the rings leave free, whatever the fill does
    with them (`whole_sequences_fit`): the fill cannot fail for want of tokens."""
    ring_ranks: int = 0
    """Ranks the level's rings and USP groups take, before the whole sequences."""
    ring_work: float = 0.0
    """Their mean modelled work then, seconds: how near the level the group sizes the
    nodes allow bring them (`ray_zep.partition.level_trace.level_sentence`)."""

    @classmethod
    def empty(cls, world: int) -> Placed:
        return cls(np.zeros(world), np.zeros(world, dtype=np.int64), np.zeros(world, dtype=bool))

    @property
    def busiest(self) -> float:
        return float("inf") if self.pruned else float(self.load.max())


def kept_room(
    placed: Placed,
    seqs: list[int],
    lengths: list[int],
    ranks: tuple[int, ...],
    held: int,
    capacity: int,
    model: WorkModel,
) -> int:
    """Tokens each member of the ring of `seqs` over `ranks` (the fullest holding `held`
    tokens) leaves free so that it can keep its peers' K/V, as the work model assumed
    (`WorkModel.keeps_kv`): recorded in `placed.kept_rings` and held as tokens, so that
    whole sequences fill only the rest. 0 where the budget alone holds them, or where the
    room is not there (the ring then sends K/V again)."""
    u = placed.ulysses.get(seqs[0], 1)
    kept = sum(n - min(placed.groups[seq][1]) * u for seq, n in zip(seqs, lengths, strict=True))
    reserve = int(model.reserved_tokens(kept, u))
    if reserve == 0 or held + reserve > capacity:
        return 0
    placed.kept_rings.add(ranks)
    return reserve


def shared_ring(
    placed: Placed, seqs: list[int], lengths: list[int], ranks: tuple[int, ...]
) -> list[int]:
    """Records sequences on one ring over `ranks` (equal chunks each); returns the tokens
    each member holds of them."""
    d = len(ranks)
    held = None  # a ring of one sequence (most) holds its counts as they are
    for seq, length in zip(seqs, lengths, strict=True):
        chunk, extra = divmod(length, d)
        counts = (chunk + 1,) * extra + (chunk,) * (d - extra)
        placed.groups[seq] = (ranks, counts)
        held = list(counts) if held is None else [h + c for h, c in zip(held, counts, strict=True)]
    return held if held is not None else [0] * d


def whole_sequences_fit(
    held: int,
    world: int,
    wholes: np.ndarray,
    lengths: np.ndarray,
    work: np.ndarray,
    level: float,
    capacity: int,
    gpus: int,
    model: WorkModel,
) -> bool:
    """Whether `fill_whole` can deal `wholes` after rings holding `held` tokens of the
    `world` ranks' without a spill finding too few free tokens: the free tokens of all
    ranks hold every whole sequence and the most room the small rings among them could
    keep for their peers' K/V (each of at most `gpus` members keeping at most the
    sequence's tokens, `kept_room`). A spill fails only where all ranks' free tokens are
    fewer than it, and the fill takes no tokens but those."""
    free = world * capacity - held - int(lengths[wholes].sum())
    if free < 0:
        return False
    if gpus < 2:
        return True
    ringable = wholes[work[wholes] >= SMALL_RING_SHARE * level]
    kept = model.reserved_tokens(lengths[ringable]).astype(np.float64)
    return float(kept.sum()) * gpus <= free


def fill_whole(
    placed: Placed,
    order: np.ndarray,
    lengths: np.ndarray,
    work: np.ndarray,
    small: np.ndarray,
    level: float,
    capacity: int,
    topology: Topology,
    model: WorkModel,
    prune_above: float = float("inf"),
) -> None:
    """Best fit decreasing of whole sequences under `level`, token room permitting; one
    that fits under it nowhere becomes a small intra-node ring where that fits. Stops,
    `placed` marked pruned, once a rank's work reaches `prune_above`, or once the
    sequences left must bring a rank there (checked every `CHECK_EVERY`; `placed.given_up`).

    `order` is by work, most first, so once a sequence's work is under
    `SMALL_RING_SHARE` of the level no later one becomes a ring: from there on each
    sequence is dealt by one search of the load index. The dealing runs compiled
    (`fill_kernel.deal`): it places the small rings itself and records them
    (`_add_rings` writes their groups); the spills it hands back are placed here."""
    sizes = lengths[order].astype(np.int64)
    works = np.ascontiguousarray(work[order], dtype=np.float64)
    rows = np.ascontiguousarray(small[order], dtype=np.float64)
    check = hopeless_check(sizes, works, prune_above, CHECK_EVERY)
    # sequences may become small rings up to the first too light for one (`order`: most
    # work first), and each adds at most one group
    closed = np.flatnonzero(works < SMALL_RING_SHARE * level)
    ringable = int(closed[0]) if closed.size else order.size
    labels = RingLabels(placed.groups, placed.load.size, topology.gpus_per_node, order.size)
    labels.now()
    index = new_index(placed.load.size)
    local = np.full(order.size, -1, dtype=np.int64)
    # `fill_kernel`'s position, rings open, hopeless, rings recorded, next label (set below)
    state = np.asarray([0, 1, 0, 0, 0], dtype=np.int64)
    rings = np.empty((ringable, RING_HEAD + topology.gpus_per_node), dtype=np.int64)
    kept_kv = np.asarray([model.kept_bytes_per_token, model.keep_kv_bytes,
                          model.room_per_token], dtype=np.float64)  # fmt: skip
    rises_above = level * (1 + SECOND_RING_ABOVE)
    while True:
        state[NEXT_LABEL] = len(labels.known)
        stop = deal(state, sizes, works, rows, placed.load, placed.tokens, placed.in_ring,
                    labels.labels, index, local, float(level), int(capacity),
                    float(prune_above), SMALL_RING_SHARE * level, rises_above, SECOND_RINGS,
                    topology.gpus_per_node, check, labels.sizes, rings,
                    kept_kv)  # fmt: skip
        _add_rings(placed, rings[: state[RECORDED]], order, sizes, labels)
        state[RECORDED] = 0
        if stop != SPILL:
            break
        position = int(state[POSITION])
        seq, n, w = int(order[position]), int(sizes[position]), float(works[position])
        ring = _spill_in_node(placed, n, capacity, topology.gpus_per_node)
        _add_spill(placed, seq, n, w, ring or spill_ranks(placed, n, capacity), capacity)
        taken = placed.groups[seq][0]
        labels.added(taken)
        ring_ranks = np.asarray(taken, dtype=np.int64)
        if placed.load[ring_ranks].max() >= prune_above:
            stop = GIVEN_UP
            break
        for rank in ring_ranks.tolist():
            move(index, rank, placed.load, placed.tokens)
        state[POSITION] = position + 1
    placed.pruned = placed.pruned or stop == GIVEN_UP
    placed.given_up = bool(state[HOPELESS])
    placed.dealt = int(state[POSITION])
    dealt = np.flatnonzero(local >= 0)
    placed.local.update(zip(order[dealt].tolist(), local[dealt].tolist(), strict=True))


def _add_rings(
    placed: Placed, rings: np.ndarray, order: np.ndarray, sizes: np.ndarray, labels: RingLabels
) -> None:
    """The small rings `fill_kernel.deal` placed on the rank arrays and labelled (its
    records, in order), written into the placement's groups by `shared_ring`,
    with the rings that keep K/V in token room (`kept_room`) and the second rings (resent)."""
    for position, flags, k, *members in rings.tolist():
        ranks = tuple(members[: k + 2])
        shared_ring(placed, [int(order[position])], [int(sizes[position])], ranks)
        if flags & SECOND:
            placed.resent.add(ranks)
        elif flags & KEPT:
            placed.kept_rings.add(ranks)
        labels.labelled(ranks)


def hopeless_check(sizes: np.ndarray, works: np.ndarray, limit: float, every: int) -> tuple:
    """What `hopeless` reads of the sequences in dealing order, under the bound `limit`:
    from each position on, their tokens and seconds summed, and the least seconds per
    token among them; checked every `every` (0: never, nor where the bound is infinite)."""
    if not np.isfinite(limit) or sizes.size == 0 or every <= 0:
        return np.zeros(0), np.zeros(0), np.zeros(0), 0, limit
    rest = np.cumsum(sizes[::-1])[::-1].astype(np.float64)
    work = np.cumsum(works[::-1])[::-1]
    density = np.minimum.accumulate((works / np.maximum(sizes, 1))[::-1])[::-1]
    return rest, work, density, every, limit


def small_ring_seconds(
    lengths: np.ndarray, gpus: int, model: WorkModel, rows: np.ndarray
) -> np.ndarray:
    """Member work of each sequence's intra-node ring of 2 .. `gpus` ranks: S x (G - 1),
    for the sequences `rows` marks; infinite (no ring fits) for the others."""
    degrees = np.arange(2, gpus + 1)
    small = np.full((lengths.size, degrees.size), np.inf)
    picked = lengths[rows]
    if degrees.size and picked.size:
        grid_n = np.repeat(picked, degrees.size)
        grid_d = np.tile(degrees, picked.size)
        small[rows] = model.alone_ring_seconds(grid_n, grid_d).reshape(picked.size, -1)
    return small


def _small_ring(
    placed: Placed,
    n: int,
    member: np.ndarray,
    level: float,
    capacity: int,
    topology: Topology,
    labels: RingLabels | None,
) -> tuple[tuple[int, ...], float, bool] | None:
    """The fewest GPUs of one node (2 .. G), in no ring yet, whose work room and token
    room take a ring over `n` tokens (`member`: its member work at each of those sizes),
    its member work and False; where no node has them, the same among ranks of one node
    that are all members of one ring (`ray_zep.partition.co_rings`), and True; None
    where neither is there. One question at a time on a placement (the fill asks the same
    inside its compiled dealing, `fill_kernel.deal`)."""
    if topology.gpus_per_node < 2:
        return None
    alone = _spare_ring(placed, n, member, level, capacity, topology)
    if alone is not None:
        return (*alone, False)
    if labels is None:
        return None
    ring = co_member_ring(labels, placed.load, placed.tokens, n, member, level, capacity)
    return None if ring is None else (*ring, True)


def _spare_ring(
    placed: Placed,
    n: int,
    member: np.ndarray,
    level: float,
    capacity: int,
    topology: Topology,
) -> tuple[tuple[int, ...], float] | None:
    """`_small_ring` on ranks in no ring: of the nodes with enough such ranks for the
    fewest, the one with the least load, and its least loaded ranks
    (`ring_search_kernel.spare_ring`)."""
    ranks, k = spare_ring(placed.in_ring, placed.tokens, placed.load, n, member, level, capacity,
                          topology.gpus_per_node)  # fmt: skip
    return None if k < 0 else (tuple(ranks.tolist()), float(member[k]))


def _spill_in_node(placed: Placed, n: int, capacity: int, gpus: int) -> tuple[int, ...] | None:
    """The fewest ranks of one node whose free tokens hold `n` (its freest; of the nodes
    needing as few, the one with most free tokens); None where no node can: a spill
    inside a node sends nothing over NICs."""
    free = (capacity - placed.tokens).reshape(-1, gpus)
    order = np.argsort(-free, axis=1, kind="stable")
    held = np.cumsum(np.take_along_axis(free, order, axis=1), axis=1)
    enough = held[:, -1] >= n
    if not enough.any():
        return None
    count = np.argmax(held >= n, axis=1) + 1
    fewest = enough & (count == count[enough].min())
    node = int(np.argmax(np.where(fewest, held[:, -1], -1)))
    chosen = order[node, : int(count[node])]
    return tuple(sorted((node * gpus + chosen).tolist()))


def spill_ranks(placed: Placed, n: int, capacity: int) -> tuple[int, ...]:
    """Ranks with most free tokens, as many as hold `n` (no rank has room for it whole)."""
    free = capacity - placed.tokens
    order = _most_free_first(free, SPILL_CANDIDATES)
    held = np.cumsum(free[order])
    if held[-1] < n and order.size < free.size:  # the top ranks lack room: all of them
        order = _most_free_first(free, free.size)
        held = np.cumsum(free[order])
    count = int(np.searchsorted(held, n)) + 1
    return tuple(sorted(order[:count].tolist()))


def _most_free_first(free: np.ndarray, top: int) -> np.ndarray:
    """The ranks with at least the `top`-th most free tokens (more on ties), most free
    first, the lowest rank first on ties: the head of a stable sort of all of them."""
    if top < free.size:
        order = np.flatnonzero(free >= np.partition(free, free.size - top)[free.size - top])
    else:
        order = np.arange(free.size)
    return order[np.argsort(-free[order], kind="stable")]


def _add_spill(
    placed: Placed, seq: int, n: int, w: float, ranks: tuple[int, ...], capacity: int
) -> None:
    """A ring over `ranks` filling their free tokens (the water-filled shares)."""
    counts = water_fill(n, capacity - placed.tokens[list(ranks)])
    keep = counts > 0
    ranks = tuple(r for r, k in zip(ranks, keep, strict=True) if k)
    counts = counts[keep]
    placed.groups[seq] = (ranks, tuple(counts.tolist()))
    placed.load[list(ranks)] += w * counts / n
    placed.tokens[list(ranks)] += counts
    placed.in_ring[list(ranks)] = True
