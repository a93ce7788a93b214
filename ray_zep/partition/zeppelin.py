"""Zeppelin's hierarchical sequence partitioner (paper §3.1, Algorithms 1 and 2).

Stage 1 (inter-node, Alg. 1) sends every sequence either whole to one node or
spread over several; stage 2 (intra-node, Alg. 2) places each node's share on
its GPUs: the node's parts of spread sequences over all of its GPUs, long
sequences on intra-node rings, the rest whole on one GPU (the local zone).
Both stages process sequences longest first. When a whole sequence fits
nowhere, the threshold drops and the stage starts over, as in the paper (see
`_search` for how the rounds are searched); a fully split batch always fits,
so it ends. The split zone is therefore always "every sequence at least as long
as the threshold" plus, under the cost policy, those the cost model wants split
(also an upper set, since the wanted degree grows with length): a sequence
shorter than every split sequence of its node is never split.

Choices where the pseudo-code is silent or would break the capacity L:

- Whole sequences are placed first and split ones after, into the room left:
  a split sequence can take any shape, so it absorbs the fragmentation that
  whole ones leave and one or two promotions make a full batch fit (placing
  split sequences first, as the pseudo-code does, leaves equal gaps that whole
  sequences must tile exactly, which promotes nearly every sequence).
- Every split is capacity-aware: tokens go to ring members by water-filling
  their free space (`fill.water_fill`), never round-robin, so no rank ever holds
  more than L tokens (a literal round-robin overshoots L on mixed batches).
- A spread sequence takes the nodes with most room; an intra-node ring the least
  loaded GPUs with room; both take more while the chosen ones lack room. Ring
  members are ordered node by node, GPU by GPU, so only one hop per node
  crosses a NIC.
- The paper's c_avg (per-GPU quadratic budget of Alg. 2) sums the squared
  lengths of everything the node holds, its parts of spread sequences included.

Zone policies (`parallel.zone_policy`):

- `capacity` — the paper's rules: s1 = P x L, a spread sequence takes
  ceil(s / s_avg) nodes; s0 = L, an intra-node sequence takes ceil(s^2 / c_avg)
  GPUs; local sequences go to the GPU with the fewest tokens.
- `cost` — thresholds and degrees from the cost model: a sequence is split
  over more nodes (GPUs) only when its attention work is at least 1.5x the mean
  per node (GPU), into the number of parts whose work is nearest the mean, and
  never into chunks shorter than the link's crossover length (below it the
  ring transfer is exposed, Fig. 5 of the paper); capacity still forces
  splits. A node's part of a spread sequence goes to as few of its GPUs as
  crossover-length chunks need (the ones with most room), since every ring
  step waits for the largest chunk. Local sequences go to the GPU with the
  least attention work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ray_zep.config import DkvWire, ParallelConfig, ZonePolicy
from ray_zep.costmodel import CostModel
from ray_zep.errors import PlacementError
from ray_zep.model_shapes import ModelShape
from ray_zep.parallel.axes import SEQUENCE_AXES, Placement
from ray_zep.partition.balance import balance
from ray_zep.partition.exchange import Exchange
from ray_zep.partition.fill import check_total, place_whole, water_fill
from ray_zep.partition.level_trace import LevelTry
from ray_zep.partition.plan import AttentionPlan, SeqPlacement, bounds_for_counts, peer_tokens
from ray_zep.partition.spec import Bench, PlacementSpec, Role, Variant, listed_in
from ray_zep.partition.work import WorkModel
from ray_zep.topology import LinkKind, Topology


@dataclass(frozen=True)
class _Rules:
    """Split degrees of one policy for one batch."""

    policy: ZonePolicy
    lengths: np.ndarray
    nodes: int
    gpus: int
    capacity: int
    inter_chunk: int
    """Shortest chunk per rank worth an inter-node ring (cost policy)."""
    intra_chunk: int

    def node_counts(self, lengths: np.ndarray, node_work: float) -> np.ndarray:
        """Nodes each sequence wants to span (1 = whole on one node)."""
        if self.policy is ZonePolicy.CAPACITY:
            s_avg = max(1.0, float(self.lengths.sum()) / self.nodes)
            return np.minimum(self.nodes, np.ceil(lengths / s_avg)).astype(np.int64)
        return _degrees(lengths, node_work, self.gpus * self.inter_chunk, self.nodes)

    def gpu_counts(self, lengths: np.ndarray, gpu_work: float, node_squares: float) -> np.ndarray:
        """GPUs of one node each intra-node sequence wants (1 = local)."""
        if self.policy is ZonePolicy.CAPACITY:
            c_avg = max(1.0, node_squares / self.gpus)
            squares = lengths.astype(np.float64) ** 2
            return np.minimum(self.gpus, np.ceil(squares / c_avg)).astype(np.int64)
        return _degrees(lengths, gpu_work, self.intra_chunk, self.gpus)


def _degrees(lengths: np.ndarray, budget: float, min_chunk: int, limit: int) -> np.ndarray:
    """Parts whose work is nearest `budget` for each sequence, in chunks >= `min_chunk`.

    Rounded, not ceiled: a sequence 10% over the mean is not worth a ring.
    """
    work = lengths.astype(np.float64) ** 2
    if budget <= 0:
        return np.ones(len(lengths), dtype=np.int64)
    parts = np.floor(work / budget + 0.5)
    wanted = np.minimum(parts, np.minimum(lengths // max(1, min_chunk), limit))
    return np.maximum(1, wanted).astype(np.int64)


def plan_zeppelin(
    lengths: np.ndarray,
    topology: Topology,
    tokens_per_rank: int,
    cost: CostModel,
    policy: ZonePolicy = ZonePolicy.COST,
    routed: bool = False,
    dkv_wire: DkvWire = DkvWire.FLOAT32,
    usp_groups: bool = True,
    keep_kv_gb: float = 0.0,
    keep_room_mb: float = 0.0,
    ulysses_pieces: int = 1,
) -> AttentionPlan:
    """Place a batch with Zeppelin's two-stage partitioner.

    Args:
        lengths: sequence lengths of the global batch (all >= 1).
        topology: nodes, GPUs per node and links.
        tokens_per_rank: L, hard token capacity of one GPU.
        cost: the cost model (crossover chunk lengths of the links).
        policy: how zone thresholds and split degrees are chosen.
        routed: inter-node ring hops go through proxies (`parallel.routing`); the
            work policy weighs them at every NIC's bandwidth.
        dkv_wire: the dtype ring dK/dV travel in (`parallel.dkv_wire`), for the work
            policy's backward transfers.
        usp_groups: the work policy may run sequences as USP groups
            (`parallel.usp_groups`).
        keep_kv_gb: the work policy's rings keep up to this many GB of their peers'
            K/V for the backward (`parallel.ring_kv_keep_gb` as
            `ray_zep.partition.plan_memory.planning_parallel` resolves it; unset: none).
        keep_room_mb: the work policy's ring members keep this many MB more for each
            token they hold below `tokens_per_rank` (`parallel.ring_kv_room_mb`), and
            then hold that many fewer whole sequences.
        ulysses_pieces: USP groups exchange heads in this many pieces beside the
            projections (`ParallelConfig.ulysses_pieces`), for the work policy's costs.

    Returns:
        The validated plan.

    Raises:
        PlacementError: the batch holds more than world x L tokens.
    """
    started = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    check_total(lengths, topology.world_size, tokens_per_rank, Placement.ZEPPELIN.value)
    model = None
    if policy is ZonePolicy.WORK:
        model = WorkModel.create(cost.shape, topology, routed=routed, dkv_wire=dkv_wire,
                                 keep_kv_gb=keep_kv_gb, room_mb=keep_room_mb,
                                 capacity=tokens_per_rank,
                                 ulysses_pieces=ulysses_pieces)  # fmt: skip
        levels: list[LevelTry] = []
        try:
            placements = balance(lengths, topology, tokens_per_rank, model, usp_groups, levels)
        except PlacementError:
            # rings of equal chunks do not fit L (a batch that fills nearly every
            # token): the cost policy's capacity-aware splits place it
            policy = ZonePolicy.COST
        else:
            plan = AttentionPlan(Placement.ZEPPELIN, topology, tokens_per_rank, tuple(placements),
                                 levels=tuple(levels))  # fmt: skip
            plan.planner_seconds = time.perf_counter() - started
            return plan
    rules = _Rules(
        policy,
        lengths,
        topology.nodes,
        topology.gpus_per_node,
        tokens_per_rank,
        cost.crossover_tokens(LinkKind.INTER_NODE),
        cost.crossover_tokens(LinkKind.INTRA_NODE),
    )
    order = np.argsort(-lengths, kind="stable")
    whole, spread = _split_over_nodes(lengths, order, rules)
    local_rank: dict[int, int] = {}
    members: dict[int, list[tuple[int, int]]] = {}
    for node in range(topology.nodes):
        portions = [
            (seq, share) for seq, shares in spread.items() for n, share in shares if n == node
        ]
        local, split = _split_over_gpus(lengths, whole[node], portions, rules)
        first = node * topology.gpus_per_node
        for seq, gpu in local.items():
            local_rank[seq] = first + gpu
        for seq, counts in split.items():
            members.setdefault(seq, []).extend((first + gpu, c) for gpu, c in counts)
    placements = []
    for seq, length in enumerate(lengths.tolist()):
        rank = local_rank.get(seq)
        if rank is not None:
            placements.append(SeqPlacement(seq, length, (rank,), (0, length // 2, length)))
            continue
        ranked = sorted(members[seq])
        ranks = tuple(r for r, _ in ranked)
        placements.append(
            SeqPlacement(seq, length, ranks, bounds_for_counts([c for _, c in ranked]))
        )
    if model is not None:  # the work policy's fallback keeps K/V as the work policy does
        placements = _keeping(placements, model, topology.world_size)
    plan = AttentionPlan(Placement.ZEPPELIN, topology, tokens_per_rank, tuple(placements))
    plan.planner_seconds = time.perf_counter() - started
    return plan


def _keeping(placements: list[SeqPlacement], model: WorkModel, world: int) -> list[SeqPlacement]:
    """`placements` with each ring keeping its K/V for the backward (`Exchange.RING_KEPT`)
    where every member's kept K/V, over all its rings, stays within the model's budget
    (`WorkModel.keeps_kv`); a rank may sit in several rings here."""
    kept = np.zeros(world)
    out = []
    for p in placements:
        if p.ring_size > 1:
            others = peer_tokens([p.position_tokens(r) for r in range(p.ring_size)], p.ulysses)
            ranks = list(p.ranks)
            if np.all(model.keeps_kv(kept[ranks] + others)):
                kept[ranks] += others
                p = p._replace(exchange=Exchange.RING_KEPT)
        out.append(p)
    return out


def _search(run_round, initial: int, lengths: np.ndarray):
    """Run placement rounds with falling thresholds; the first that places everything wins.

    `run_round(threshold)` returns a placement, or None when a whole sequence fits
    nowhere. The thresholds are the paper's: the initial one, then each distinct
    length below it, longest first (s <- max of the whole zone). Galloping and
    bisection over that list find the paper's answer whenever success is
    monotone in the threshold, in O(log S) rounds instead of up to S. The last
    threshold splits everything, which always fits.
    """
    below = np.unique(lengths[lengths < initial])[::-1]
    candidates = [initial, *below.tolist()]
    if len(candidates) > 1:
        candidates[-1] = 1
    low, high, step = -1, 0, 1
    while (result := run_round(candidates[high])) is None:
        if high == len(candidates) - 1:
            raise PlacementError("zeppelin: no threshold places the batch")
        low, high, step = high, min(high + step, len(candidates) - 1), step * 2
    best = result
    while high - low > 1:
        middle = (low + high) // 2
        attempt = run_round(candidates[middle])
        if attempt is None:
            low = middle
        else:
            high, best = middle, attempt
    return best


def _split_over_nodes(
    lengths: np.ndarray, order: np.ndarray, rules: _Rules
) -> tuple[list[list[int]], dict[int, list[tuple[int, int]]]]:
    """Stage 1: each node's whole sequences, and each spread sequence's (node, tokens)."""
    nodes, node_capacity = rules.nodes, rules.gpus * rules.capacity
    node_work = float(np.square(lengths.astype(np.float64)).sum()) / nodes
    sizes = lengths[order]
    wanted = rules.node_counts(sizes, node_work)
    by_work = rules.policy is ZonePolicy.COST
    squares = np.square(sizes.astype(np.float64))  # what the cost policy balances

    def run_round(threshold: int):
        spreads = ((sizes >= threshold) | (wanted > 1)) & (nodes > 1)
        kept = np.flatnonzero(~spreads)
        placed = place_whole(
            sizes[kept].tolist(), nodes, node_capacity, squares[kept].tolist(), by_work
        )
        if placed is None:
            return None
        bins, free_left, load_now = placed
        whole: list[list[int]] = [[] for _ in range(nodes)]
        for seq, node in zip(order[kept].tolist(), bins, strict=True):
            whole[node].append(seq)
        spread: dict[int, list[tuple[int, int]]] = {}
        for i in np.flatnonzero(spreads).tolist():
            n = int(sizes[i])
            chosen = _pick_nodes(max(2, int(wanted[i])), n, free_left, load_now)
            spread[int(order[i])] = _fill(n, n, chosen, free_left, load_now)
        return whole, spread

    initial = node_capacity if rules.policy is ZonePolicy.CAPACITY else node_capacity + 1
    return _search(run_round, initial, lengths)


def _fill(
    tokens: int, length: int, chosen: np.ndarray, free: np.ndarray, load: np.ndarray
) -> list[tuple[int, int]]:
    """Water-fill `tokens` of a sequence of `length` into the `chosen` bins.

    Updates the bins' free tokens and attention work in place; returns the
    (bin, tokens) pairs that received any, in bin order.
    """
    counts = water_fill(tokens, free[chosen])
    free[chosen] -= counts
    load[chosen] += counts.astype(np.float64) * length
    return [(int(b), int(c)) for b, c in zip(chosen, counts, strict=True) if c]


def _pick_nodes(count: int, tokens: int, free: np.ndarray, load: np.ndarray) -> np.ndarray:
    """The `count` nodes with most room (least loaded on ties); more while they lack room."""
    order = [int(n) for n in np.lexsort((load, -free)) if free[n] > 0]
    chosen = order[:count]
    while int(free[chosen].sum()) < tokens:
        chosen.append(order[len(chosen)])
    return np.asarray(sorted(chosen), dtype=np.int64)


def _split_over_gpus(
    lengths: np.ndarray,
    whole: list[int],
    portions: list[tuple[int, int]],
    rules: _Rules,
) -> tuple[dict[int, int], dict[int, list[tuple[int, int]]]]:
    """Stage 2 on one node: the GPU of each local sequence, (gpu, tokens) of the others."""
    gpus = rules.gpus
    seqs = np.asarray(whole, dtype=np.int64)
    sizes = lengths[seqs]
    squares = np.square(sizes.astype(np.float64))  # what the cost policy balances
    whole_squares = float(squares.sum())
    all_squares = whole_squares + float(sum(share * share for _, share in portions))
    portion_work = float(sum(share * int(lengths[seq]) for seq, share in portions))
    gpu_work = (whole_squares + portion_work) / gpus
    wanted = rules.gpu_counts(sizes, gpu_work, all_squares)
    by_work = rules.policy is ZonePolicy.COST

    def run_round(threshold: int):
        rings = ((sizes >= threshold) | (wanted > 1)) & (gpus > 1)
        kept = np.flatnonzero(~rings)
        placed = place_whole(
            sizes[kept].tolist(), gpus, rules.capacity, squares[kept].tolist(), by_work
        )
        if placed is None:
            return None
        bins, free_left, load_now = placed
        local = dict(zip(seqs[kept].tolist(), bins, strict=True))
        split: dict[int, list[tuple[int, int]]] = {}
        for i in np.flatnonzero(rings).tolist():
            n = int(sizes[i])
            chosen = _pick_gpus(max(2, int(wanted[i])), n, free_left, load_now)
            split[int(seqs[i])] = _fill(n, n, chosen, free_left, load_now)
        for seq, share in portions:
            chosen = _portion_gpus(share, free_left, rules)
            split[seq] = _fill(share, int(lengths[seq]), chosen, free_left, load_now)
        return local, split

    initial = rules.capacity if rules.policy is ZonePolicy.CAPACITY else rules.capacity + 1
    return _search(run_round, initial, sizes)


def _pick_gpus(count: int, tokens: int, free: np.ndarray, load: np.ndarray) -> np.ndarray:
    """The `count` least loaded GPUs with room, plus more while they lack room for `tokens`."""
    order = [int(g) for g in np.lexsort((-free, load)) if free[g] > 0]
    chosen = order[:count]
    if int(free[chosen].sum()) < tokens:
        rest = sorted(order[count:], key=lambda g: -free[g])
        while int(free[chosen].sum()) < tokens:
            chosen.append(rest.pop(0))
    return np.asarray(sorted(chosen), dtype=np.int64)


def _portion_gpus(share: int, free: np.ndarray, rules: _Rules) -> np.ndarray:
    """GPUs for a node's part of a spread sequence.

    capacity: all of them (the paper spreads it over the node). cost: the GPUs
    with most room, as many as chunks of the inter-node crossover length need
    (more ranks only add ring steps once a chunk's compute no longer hides its
    transfer), and more while they lack room; uneven chunks would make every
    ring step wait for the largest.
    """
    if rules.policy is ZonePolicy.CAPACITY:
        return np.arange(len(free))
    order = np.argsort(-free, kind="stable")
    count = min(len(free), max(1, -(-share // max(1, rules.inter_chunk))))
    while count < len(free) and int(free[order[:count]].sum()) < share:
        count += 1
    return np.sort(order[:count])


def _planner(lengths, topology, capacity, shape: ModelShape, parallel: ParallelConfig):
    """`spec.Planner`: the Zeppelin plan under the config's zone policy and routing."""
    cost = CostModel.create(shape, topology)
    return plan_zeppelin(lengths, topology, capacity, cost, parallel.zone_policy, parallel.routing,
                         parallel.dkv_wire, parallel.usp_groups,
                         parallel.ring_kv_keep_gb or 0.0,
                         parallel.ring_kv_room_mb or 0.0,
                         parallel.ulysses_pieces)  # fmt: skip


_NAME = Placement.ZEPPELIN.value
WORK_POLICY = f"{_NAME}+work"
"""The full system with the work-balanced zones (`parallel.zone_policy=work`, the default)."""
COST_POLICY = f"{_NAME}+cost"
"""The full system with the cost model's zone thresholds (`parallel.zone_policy=cost`)."""
CAPACITY_POLICY = f"{_NAME}_capacity"
"""The partitioner with the paper's capacity-only zone thresholds."""
COMPUTE_DKV = f"{_NAME}+compute_dkv"
"""The full system with ring dK/dV on the wire in the K/V dtype (`parallel.dkv_wire=compute`)."""

_READS = (
    "zone_policy",
    "routing",
    "dkv_wire",
    "usp_groups",
    "ring_kv_keep_gb",
    "ring_kv_room_mb",
    "ulysses_chunks",
    "fsdp_unit",
)
"""The `ParallelConfig` fields `_planner` reads (the ring K/V budgets as
`ray_zep.partition.plan_memory.planning_parallel` resolves them)."""

SPEC = PlacementSpec(
    SEQUENCE_AXES[Placement.ZEPPELIN],
    _planner,
    variants={
        # the full system: the partitioner and engine, routing and the remapping layer
        _NAME: Variant(Placement.ZEPPELIN, routed=True, remap=True),
        WORK_POLICY: Variant(
            Placement.ZEPPELIN, routed=True, remap=True, zone_policy=ZonePolicy.WORK
        ),
        COST_POLICY: Variant(
            Placement.ZEPPELIN, routed=True, remap=True, zone_policy=ZonePolicy.COST
        ),
        CAPACITY_POLICY: Variant(
            Placement.ZEPPELIN, routed=True, remap=True, zone_policy=ZonePolicy.CAPACITY
        ),
        COMPUTE_DKV: Variant(Placement.ZEPPELIN, routed=True, remap=True, dkv_wire=DkvWire.COMPUTE),
    },
    listed={
        **listed_in(Bench.SIMULATE, Bench.TRAIN, Bench.VALIDATE, Bench.VALIDATE_QUICK),
        **listed_in(Bench.LAYERS),
        Bench.PARTITION: (_NAME, CAPACITY_POLICY),
        Bench.SCALE: (_NAME, COST_POLICY, COMPUTE_DKV),
    },
    role=Role.SYSTEM,
    zone_policies=tuple(ZonePolicy),
    reads=_READS,
)
