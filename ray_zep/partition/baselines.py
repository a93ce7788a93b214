"""The baseline planners, producing the same plan type as Zeppelin.

- `te_cp` (Transformer Engine CP): every sequence zigzag-split over one ring
  of all ranks, K and V rotated.
- `llama_cp` (LLaMA-3 CP): the same split, K and V all-gathered first.
- `hybrid_dp` (the Zeppelin paper's Hybrid DP baseline, after ByteScale):
  sequences longer than L on ring groups of ceil(s / L) ranks, shorter ones
  whole on the rank with the least attention FLOPs that has room (least modelled
  seconds under `parallel.zone_policy=work`); a short one that fits nowhere is
  split over the ranks with most room (where the baseline would open another
  micro-batch).
- `ulysses`: every sequence split over all ranks, heads exchanged by
  all-to-all; needs H % world == 0, and world % K == 0 when world > K.
- `usp`: Ulysses inside groups of U consecutive ranks (a node by default),
  zigzag ring across the world / U groups.

Splits water-fill the ranks' free space, so the one-token remainders of many
short sequences spread over the ranks instead of piling up on one.
"""

from __future__ import annotations

import math
import time

import numpy as np

from ray_zep.config import ParallelConfig, ZonePolicy
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import ModelShape
from ray_zep.parallel.axes import SEQUENCE_AXES, Placement
from ray_zep.partition.fill import check_total, water_fill, water_fill_rows
from ray_zep.partition.plan import (
    AttentionPlan,
    Exchange,
    SeqPlacement,
    bounds_for_counts,
    local_placement,
)
from ray_zep.partition.spec import Bench, PlacementSpec, Role, Variant, listed_in
from ray_zep.partition.work import WorkModel
from ray_zep.topology import Topology


def plan_global_ring(
    lengths: np.ndarray,
    topology: Topology,
    tokens_per_rank: int,
    exchange: Exchange = Exchange.RING,
    name: Placement = Placement.TE_CP,
) -> AttentionPlan:
    """One ring of all ranks exchanging by `exchange`, planned as placement `name`: te_cp
    (ring exchange) or llama_cp (all-gather exchange)."""
    started = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    world = topology.world_size
    check_total(lengths, world, tokens_per_rank, name.value)
    free = np.full(world, tokens_per_rank, dtype=np.int64)
    ranks = tuple(range(world))
    placements = []
    for seq, n in enumerate(lengths.tolist()):
        counts = water_fill(n, free)
        free -= counts
        placements.append(
            SeqPlacement(seq, n, ranks, bounds_for_counts(counts.tolist()), exchange=exchange)
        )
    return _finish(name, topology, tokens_per_rank, placements, started)


def plan_hybrid_dp(
    lengths: np.ndarray, topology: Topology, tokens_per_rank: int, model: WorkModel | None = None
) -> AttentionPlan:
    """Hybrid DP: long sequences on CP rings, short ones balanced by attention FLOPs, or
    by modelled seconds with `model` (`parallel.zone_policy=work`: linear and attention
    work at the per-length rates, a ring member its share of its ring's member work)."""
    started = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    world = topology.world_size
    check_total(lengths, world, tokens_per_rank, Placement.HYBRID_DP.value)
    free = np.full(world, tokens_per_rank, dtype=np.int64)
    load = np.zeros(world, dtype=np.float64)
    whole = lengths.astype(np.float64) ** 2 if model is None else model.whole_seconds(lengths)
    placements: list[SeqPlacement | None] = [None] * len(lengths)
    for seq in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[seq])
        fits = free >= n
        if n <= tokens_per_rank and fits.any():
            rank = int(np.argmin(np.where(fits, load, np.inf)))
            placements[seq] = local_placement(seq, n, rank)
            free[rank] -= n
            load[rank] += whole[seq]
            continue
        size = max(2, math.ceil(n / tokens_per_rank))
        chosen = _most_free(size, n, free)
        counts = water_fill(n, free[chosen])
        keep = counts > 0
        chosen, counts = chosen[keep], counts[keep]
        free[chosen] -= counts
        if model is None:
            load[chosen] += counts.astype(np.float64) * n
        else:  # each member's share of a member's work on a ring of equal chunks
            member = float(model.alone_ring_seconds(np.asarray([n]), np.asarray([chosen.size]))[0])
            load[chosen] += member * counts * chosen.size / n
        ranks = tuple(int(r) for r in chosen)
        placements[seq] = SeqPlacement(seq, n, ranks, bounds_for_counts(counts.tolist()))
    return _finish(Placement.HYBRID_DP, topology, tokens_per_rank, placements, started)


def _most_free(count: int, tokens: int, free: np.ndarray) -> np.ndarray:
    order = np.argsort(-free, kind="stable")
    take = count
    while take < len(free) and int(free[order[:take]].sum()) < tokens:
        take += 1
    return np.sort(order[:take])


def check_ulysses_degree(degree: int, shape: ModelShape, key: str) -> None:
    """The CP seed's head rules for `degree` Ulysses members.

    Raises:
        ConfigError: H % U != 0, or U > K with U % K != 0.
    """
    fault = shape.ulysses_fault(degree)
    if fault:
        raise ConfigError(f"config key {key}: {fault}")


def usp_degree(requested: int, topology: Topology, shape: ModelShape) -> int:
    """U for usp: `parallel.ulysses_degree`, or GPUs per node (the largest divisor of it
    that the head rules accept, below the world size so a ring remains)."""
    world = topology.world_size
    if requested:
        if world % requested:
            raise ConfigError(
                f"config key parallel.ulysses_degree={requested}: must divide the "
                f"{world} ranks of the topology"
            )
        check_ulysses_degree(requested, shape, "parallel.ulysses_degree")
        return requested
    for degree in range(topology.gpus_per_node, 0, -1):
        if topology.gpus_per_node % degree or (degree == world and world > 1):
            continue
        try:
            check_ulysses_degree(degree, shape, "parallel.ulysses_degree")
        except ConfigError:
            continue
        return degree
    return 1


def plan_ulysses_ring(
    lengths: np.ndarray,
    topology: Topology,
    tokens_per_rank: int,
    degree: int,
) -> AttentionPlan:
    """ulysses (degree = world) or usp (ring over world / degree groups of `degree` ranks)."""
    started = time.perf_counter()
    name = Placement.ULYSSES if degree == topology.world_size else Placement.USP
    lengths = np.asarray(lengths, dtype=np.int64)
    world = topology.world_size
    check_total(lengths, world, tokens_per_rank, name.value)
    ring = world // degree
    free = np.full(world, tokens_per_rank, dtype=np.int64)
    ranks = tuple(range(world))
    placements = []
    for seq, n in enumerate(lengths.tolist()):
        by_position = free.reshape(ring, degree)
        position_counts = water_fill(n, by_position.sum(axis=1))
        parts = water_fill_rows(position_counts, by_position).reshape(-1)
        free -= parts
        placements.append(
            SeqPlacement(
                seq,
                n,
                ranks,
                bounds_for_counts(position_counts.tolist()),
                ulysses=degree,
                parts=tuple(parts.tolist()),
            )
        )
    return _finish(name, topology, tokens_per_rank, placements, started)


def _finish(
    name: Placement,
    topology: Topology,
    tokens_per_rank: int,
    placements: list,
    started: float,
) -> AttentionPlan:
    plan = AttentionPlan(name, topology, tokens_per_rank, tuple(placements))
    plan.planner_seconds = time.perf_counter() - started
    return plan


def _hybrid_dp(lengths, topology, capacity, shape, parallel: ParallelConfig) -> AttentionPlan:
    if parallel.zone_policy is ZonePolicy.WORK:
        model = WorkModel.create(shape, topology, routed=parallel.routing,
                                 dkv_wire=parallel.dkv_wire)  # fmt: skip
        return plan_hybrid_dp(lengths, topology, capacity, model)
    return plan_hybrid_dp(lengths, topology, capacity)


def _ulysses(lengths, topology, capacity, shape, parallel: ParallelConfig) -> AttentionPlan:
    check_ulysses_degree(topology.world_size, shape, "parallel.sequence=ulysses")
    return plan_ulysses_ring(lengths, topology, capacity, topology.world_size)


def _usp(lengths, topology, capacity, shape, parallel: ParallelConfig) -> AttentionPlan:
    degree = usp_degree(parallel.ulysses_degree, topology, shape)
    return plan_ulysses_ring(lengths, topology, capacity, degree)


def _global_ring(exchange: Exchange, name: Placement):
    """The planner of `name`: every sequence on one ring of all ranks, K/V exchanged by
    `exchange`."""
    return lambda n, t, c, s, p: plan_global_ring(n, t, c, exchange, name)


_EVERY_BENCH_BUT_SCALE = tuple(b for b in Bench if b is not Bench.SCALE)
TE_CP = PlacementSpec(
    SEQUENCE_AXES[Placement.TE_CP],
    _global_ring(Exchange.RING, Placement.TE_CP),
    # modelled as TransformerEngine runs it: its dK/dV wire dtype and THD padding
    variants={Placement.TE_CP.value: Variant(Placement.TE_CP, te_wire=True, te_padding=True)},
    listed=listed_in(*_EVERY_BENCH_BUT_SCALE),
    role=Role.REFERENCE,
    reads=(),
)
LLAMA_CP = PlacementSpec(
    SEQUENCE_AXES[Placement.LLAMA_CP],
    _global_ring(Exchange.ALL_GATHER, Placement.LLAMA_CP),
    listed=listed_in(Bench.SIMULATE, Bench.TRAIN, Bench.VALIDATE, Bench.PARTITION),
    reads=(),
)
HYBRID_DP = PlacementSpec(
    SEQUENCE_AXES[Placement.HYBRID_DP],
    _hybrid_dp,
    # the Zeppelin paper's baseline balances attention FLOPs, whatever the config's policy
    variants={Placement.HYBRID_DP.value: Variant(Placement.HYBRID_DP, zone_policy=ZonePolicy.COST)},
    listed=listed_in(
        Bench.SIMULATE, Bench.TRAIN, Bench.VALIDATE, Bench.LAYERS, Bench.PARTITION, Bench.SCALE
    ),
    reads=("zone_policy", "routing", "dkv_wire"),
)
ULYSSES = PlacementSpec(
    SEQUENCE_AXES[Placement.ULYSSES],
    _ulysses,
    listed=listed_in(Bench.VALIDATE, Bench.PARTITION),
    reads=(),
)
USP = PlacementSpec(
    SEQUENCE_AXES[Placement.USP],
    _usp,
    listed=listed_in(Bench.VALIDATE, Bench.LAYERS, Bench.PARTITION),
    reads=("ulysses_degree",),
)
