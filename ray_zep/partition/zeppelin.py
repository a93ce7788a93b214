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
  over more nodes (GPUs) only when its attention time exceeds the mean per node
  (GPU), into just enough parts to bring it under the mean, and never into
  chunks shorter than the link's crossover length (below it the ring transfer
  is exposed, Fig. 5 of the paper); capacity still forces splits. Local
  sequences go to the GPU with the least attention work.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from ray_zep.config import ZonePolicy
from ray_zep.costmodel import CostModel
from ray_zep.errors import PlacementError
from ray_zep.partition.fill import check_total, water_fill
from ray_zep.partition.plan import AttentionPlan, SeqPlacement, bounds_for_counts
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

    def node_count(self, length: int, node_work: float) -> int:
        """Nodes a sequence wants to span (1 = whole on one node)."""
        if self.policy is ZonePolicy.CAPACITY:
            s_avg = max(1.0, float(self.lengths.sum()) / self.nodes)
            return min(self.nodes, math.ceil(length / s_avg))
        return self._degree(length, node_work, self.gpus * self.inter_chunk, self.nodes)

    def gpu_count(self, length: int, gpu_work: float, node_squares: float) -> int:
        """GPUs of one node an intra-node sequence wants (1 = local)."""
        if self.policy is ZonePolicy.CAPACITY:
            c_avg = max(1.0, node_squares / self.gpus)
            return min(self.gpus, math.ceil(length * length / c_avg))
        return self._degree(length, gpu_work, self.intra_chunk, self.gpus)

    @staticmethod
    def _degree(length: int, budget: float, min_chunk: int, limit: int) -> int:
        work = float(length) * length
        if budget <= 0 or work <= budget:
            return 1
        wanted = math.ceil(work / budget)
        return max(1, min(wanted, length // max(1, min_chunk), limit))


def plan_zeppelin(
    lengths: np.ndarray,
    topology: Topology,
    tokens_per_rank: int,
    cost: CostModel,
    policy: ZonePolicy = ZonePolicy.COST,
) -> AttentionPlan:
    """Place a batch with Zeppelin's two-stage partitioner.

    Args:
        lengths: sequence lengths of the global batch (all >= 1).
        topology: nodes, GPUs per node and links.
        tokens_per_rank: L, hard token capacity of one GPU.
        cost: the cost model (crossover chunk lengths of the links).
        policy: how zone thresholds and split degrees are chosen.

    Returns:
        The validated plan.

    Raises:
        PlacementError: the batch holds more than world x L tokens.
    """
    started = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    check_total(lengths, topology.world_size, tokens_per_rank, "zeppelin")
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
    members: dict[int, list[tuple[int, int]]] = {}
    for node in range(topology.nodes):
        portions = [
            (seq, share) for seq, shares in spread.items() for n, share in shares if n == node
        ]
        placed = _split_over_gpus(lengths, whole[node], portions, rules)
        first = node * topology.gpus_per_node
        for seq, counts in placed.items():
            members.setdefault(seq, []).extend((first + gpu, c) for gpu, c in counts)
    placements = []
    for seq, length in enumerate(lengths.tolist()):
        ranked = sorted(members[seq])
        ranks = tuple(rank for rank, _ in ranked)
        placements.append(
            SeqPlacement(seq, length, ranks, bounds_for_counts([c for _, c in ranked]))
        )
    plan = AttentionPlan("zeppelin", topology, tokens_per_rank, tuple(placements))
    plan.planner_seconds = time.perf_counter() - started
    return plan


def _search(run_round, initial: int, lengths: np.ndarray):
    """Run placement rounds with falling thresholds; the first that places everything wins.

    `run_round(threshold)` returns a placement, or None when a whole sequence fits
    nowhere. The thresholds are the paper's: the initial one, then each distinct
    length below it, longest first (s <- max of the whole zone). Galloping and
    bisection over that list find the paper's answer whenever success is
    monotone in the threshold, in O(log S) rounds instead of up to S. The last
    threshold splits everything, which always fits.
    """
    candidates = [initial, *sorted({int(n) for n in lengths if n < initial}, reverse=True)]
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
    wanted = {seq: rules.node_count(int(lengths[seq]), node_work) for seq in order.tolist()}

    def run_round(threshold: int):
        free = np.full(nodes, node_capacity, dtype=np.int64)
        load = np.zeros(nodes, dtype=np.float64)
        whole: list[list[int]] = [[] for _ in range(nodes)]
        split = [s for s in order.tolist() if lengths[s] >= threshold or wanted[s] > 1]
        if nodes == 1:
            split = []
        chosen_set = set(split)
        for seq in order.tolist():
            if seq in chosen_set:
                continue
            n = int(lengths[seq])
            key = free if rules.policy is ZonePolicy.CAPACITY else -load
            node = int(np.argmax(np.where(free >= n, key, -np.inf)))
            if free[node] < n:
                return None
            whole[node].append(seq)
            free[node] -= n
            load[node] += float(n) * n
        spread: dict[int, list[tuple[int, int]]] = {}
        for seq in split:
            n = int(lengths[seq])
            chosen = _pick_nodes(max(2, wanted[seq]), n, free, load)
            shares = water_fill(n, free[chosen])
            spread[seq] = [(int(c), int(x)) for c, x in zip(chosen, shares, strict=True) if x]
            free[chosen] -= shares
            load[chosen] += shares.astype(np.float64) * n
        return whole, spread

    initial = node_capacity if rules.policy is ZonePolicy.CAPACITY else node_capacity + 1
    return _search(run_round, initial, lengths)


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
) -> dict[int, list[tuple[int, int]]]:
    """Stage 2 on one node: (gpu, tokens) of every sequence the node holds."""
    gpus = rules.gpus
    whole_squares = float(sum(int(lengths[s]) ** 2 for s in whole))
    squares = whole_squares + float(sum(share * share for _, share in portions))
    portion_work = float(sum(share * int(lengths[seq]) for seq, share in portions))
    gpu_work = (whole_squares + portion_work) / gpus
    wanted = {seq: rules.gpu_count(int(lengths[seq]), gpu_work, squares) for seq in whole}

    def run_round(threshold: int):
        free = np.full(gpus, rules.capacity, dtype=np.int64)
        load = np.zeros(gpus, dtype=np.float64)
        placed: dict[int, list[tuple[int, int]]] = {}
        ring = [s for s in whole if gpus > 1 and (lengths[s] >= threshold or wanted[s] > 1)]
        ring_set = set(ring)
        for seq in whole:  # longest first
            if seq in ring_set:
                continue
            n = int(lengths[seq])
            gpu = _pick_local_gpu(n, free, load, rules.policy)
            if gpu < 0:
                return None
            placed[seq] = [(gpu, n)]
            free[gpu] -= n
            load[gpu] += float(n) * n
        for seq in ring:
            n = int(lengths[seq])
            chosen = _pick_gpus(max(2, wanted[seq]), n, free, load)
            counts = water_fill(n, free[chosen])
            placed[seq] = [(int(g), int(c)) for g, c in zip(chosen, counts, strict=True) if c]
            free[chosen] -= counts
            load[chosen] += counts.astype(np.float64) * n
        for seq, share in portions:
            counts = water_fill(share, free)
            placed[seq] = [(g, int(c)) for g, c in enumerate(counts) if c]
            free -= counts
            load += counts.astype(np.float64) * float(lengths[seq])
        return placed

    initial = rules.capacity if rules.policy is ZonePolicy.CAPACITY else rules.capacity + 1
    return _search(run_round, initial, lengths[whole])


def _pick_gpus(count: int, tokens: int, free: np.ndarray, load: np.ndarray) -> np.ndarray:
    """The `count` least loaded GPUs with room, plus more while they lack room for `tokens`."""
    order = [int(g) for g in np.lexsort((-free, load)) if free[g] > 0]
    chosen = order[:count]
    if int(free[chosen].sum()) < tokens:
        rest = sorted(order[count:], key=lambda g: -free[g])
        while int(free[chosen].sum()) < tokens:
            chosen.append(rest.pop(0))
    return np.asarray(sorted(chosen), dtype=np.int64)


def _pick_local_gpu(tokens: int, free: np.ndarray, load: np.ndarray, policy: ZonePolicy) -> int:
    """GPU for a whole sequence: fewest tokens (capacity) or least work (cost); -1 if none fits."""
    fits = free >= tokens
    if not fits.any():
        return -1
    key = -free if policy is ZonePolicy.CAPACITY else load
    return int(np.argmin(np.where(fits, key, np.inf)))
