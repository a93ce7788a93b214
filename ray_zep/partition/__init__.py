"""Sequence partitioners: every placement of a global batch as an AttentionPlan."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from ray_zep.config import ParallelConfig, ZonePolicy
from ray_zep.costmodel import CostModel
from ray_zep.errors import PlacementError
from ray_zep.model_shapes import ModelShape
from ray_zep.parallel.axes import SEQUENCE_AXES, Placement
from ray_zep.partition.baselines import (
    check_ulysses_degree,
    plan_global_ring,
    plan_hybrid_dp,
    plan_ulysses_ring,
    usp_degree,
)
from ray_zep.partition.plan import AttentionPlan, Exchange, local_placement
from ray_zep.partition.work import WorkModel
from ray_zep.partition.zeppelin import plan_zeppelin
from ray_zep.topology import Topology

Planner = Callable[[np.ndarray, Topology, int, ModelShape, ParallelConfig], AttentionPlan]
"""(lengths, topology, L, model shape, parallel config) -> the batch's plan."""


def _zeppelin(lengths, topology, capacity, shape, parallel) -> AttentionPlan:
    cost = CostModel.create(shape, topology)
    return plan_zeppelin(lengths, topology, capacity, cost, parallel.zone_policy, parallel.routing)


def _hybrid_dp(lengths, topology, capacity, shape, parallel) -> AttentionPlan:
    if parallel.zone_policy is ZonePolicy.WORK:
        model = WorkModel.create(shape, topology, routed=parallel.routing)
        return plan_hybrid_dp(lengths, topology, capacity, model)
    return plan_hybrid_dp(lengths, topology, capacity)


def _ulysses(lengths, topology, capacity, shape, parallel) -> AttentionPlan:
    check_ulysses_degree(topology.world_size, shape, "parallel.sequence=ulysses")
    return plan_ulysses_ring(lengths, topology, capacity, topology.world_size)


def _usp(lengths, topology, capacity, shape, parallel) -> AttentionPlan:
    degree = usp_degree(parallel.ulysses_degree, topology, shape)
    return plan_ulysses_ring(lengths, topology, capacity, degree)


def _global_ring(exchange: Exchange, name: Placement) -> Planner:
    """The planner of `name`: every sequence on one ring of all ranks, K/V exchanged by
    `exchange`."""
    return lambda n, t, c, s, p: plan_global_ring(n, t, c, exchange, name)


PLANNERS: dict[Placement, Planner] = {
    Placement.ZEPPELIN: _zeppelin,
    Placement.TE_CP: _global_ring(Exchange.RING, Placement.TE_CP),
    Placement.LLAMA_CP: _global_ring(Exchange.ALL_GATHER, Placement.LLAMA_CP),
    Placement.HYBRID_DP: _hybrid_dp,
    Placement.ULYSSES: _ulysses,
    Placement.USP: _usp,
}
"""The planner of every planned placement (the others place whole sequences from bins)."""

PLANNED = tuple(p for p in Placement if SEQUENCE_AXES[p].planned)
"""Placements whose planner computes the placement from the lengths alone."""


def make_plan(
    placement: Placement,
    lengths: Sequence[int] | np.ndarray,
    topology: Topology,
    tokens_per_rank: int,
    shape: ModelShape,
    parallel: ParallelConfig | None = None,
) -> AttentionPlan:
    """Place a batch of sequences with the planner of `placement`.

    Args:
        placement: a planned placement (whole sequences use `plan_from_bins`).
        lengths: sequence lengths of the global batch.
        topology: the cluster.
        tokens_per_rank: L.
        shape: the model (head rules, cost model).
        parallel: zone policy and Ulysses degree (defaults otherwise).

    Raises:
        PlacementError: the batch does not fit, or the placement needs bins.
        ConfigError: Ulysses head rules fail.
    """
    if placement not in PLANNERS:
        raise PlacementError(
            f"parallel.sequence={placement.value} places whole sequences from packed bins; "
            "use plan_from_bins"
        )
    parallel = parallel or ParallelConfig(sequence=placement)
    lengths = np.asarray(lengths, dtype=np.int64)
    plan = PLANNERS[placement](lengths, topology, tokens_per_rank, shape, parallel)
    plan.validate()
    return plan


def greedy_bins(lengths: Sequence[int] | np.ndarray, ranks: int) -> list[list[int]]:
    """Whole sequences, longest first, each onto the rank with the fewest tokens."""
    lengths = np.asarray(lengths, dtype=np.int64)
    bins: list[list[int]] = [[] for _ in range(ranks)]
    loads = np.zeros(ranks, dtype=np.int64)
    for seq in np.argsort(-lengths, kind="stable").tolist():
        rank = int(np.argmin(loads))
        bins[rank].append(seq)
        loads[rank] += lengths[seq]
    return bins


def plan_from_bins(
    lengths: Sequence[int] | np.ndarray,
    bins: list[list[int]],
    topology: Topology,
    tokens_per_rank: int,
    placement: Placement,
) -> AttentionPlan:
    """Plan of whole sequences on given ranks (`bins[r]` lists rank r's sequences).

    The plans of `single` (one bin, one rank) and `whole` (rank-packed bins).
    """
    started = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    rank_of = {seq: rank for rank, group in enumerate(bins) for seq in group}
    if sorted(rank_of) != list(range(len(lengths))):
        raise PlacementError(f"{placement.value}: bins must hold every sequence exactly once")
    placements = tuple(
        local_placement(seq, int(n), rank_of[seq]) for seq, n in enumerate(lengths.tolist())
    )
    plan = AttentionPlan(placement, topology, tokens_per_rank, placements)
    plan.planner_seconds = time.perf_counter() - started
    plan.validate()
    return plan
