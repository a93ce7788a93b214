"""Sequence partitioners: every strategy's placement of a global batch as an AttentionPlan."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ray_zep.config import WHOLE_SEQUENCE_STRATEGIES, ParallelConfig, Strategy
from ray_zep.costmodel import CostModel
from ray_zep.errors import PlacementError
from ray_zep.model.shapes import ModelShape
from ray_zep.partition.baselines import (
    check_ulysses_degree,
    plan_global_ring,
    plan_hybrid_dp,
    plan_ulysses_ring,
    usp_degree,
)
from ray_zep.partition.plan import AttentionPlan, Exchange, local_placement
from ray_zep.partition.zeppelin import plan_zeppelin
from ray_zep.topology import Topology

PLANNED_STRATEGIES = tuple(
    s for s in Strategy if s is not Strategy.SINGLE and s not in WHOLE_SEQUENCE_STRATEGIES
)
"""Strategies whose placement a planner computes from the lengths alone."""


def make_plan(
    strategy: Strategy,
    lengths: Sequence[int] | np.ndarray,
    topology: Topology,
    tokens_per_rank: int,
    shape: ModelShape,
    parallel: ParallelConfig | None = None,
) -> AttentionPlan:
    """Place a batch of sequences with the planner of `strategy`.

    Args:
        strategy: any strategy but single and dp (use `plan_from_bins` for those).
        lengths: sequence lengths of the global batch.
        topology: the cluster.
        tokens_per_rank: L.
        shape: the model (head rules, cost model).
        parallel: zone policy and Ulysses degree (defaults otherwise).

    Raises:
        PlacementError: the batch does not fit, or the strategy needs bins.
        ConfigError: Ulysses head rules fail.
    """
    parallel = parallel or ParallelConfig(strategy=strategy)
    lengths = np.asarray(lengths, dtype=np.int64)
    if strategy is Strategy.ZEPPELIN:
        cost = CostModel.create(shape, topology)
        plan = plan_zeppelin(lengths, topology, tokens_per_rank, cost, parallel.zone_policy)
    elif strategy is Strategy.TE_CP:
        plan = plan_global_ring(lengths, topology, tokens_per_rank, Exchange.RING)
    elif strategy is Strategy.LLAMA_CP:
        plan = plan_global_ring(lengths, topology, tokens_per_rank, Exchange.ALL_GATHER)
    elif strategy is Strategy.HYBRID_DP:
        plan = plan_hybrid_dp(lengths, topology, tokens_per_rank)
    elif strategy is Strategy.ULYSSES:
        check_ulysses_degree(topology.world_size, shape, "parallel.strategy=ulysses")
        plan = plan_ulysses_ring(lengths, topology, tokens_per_rank, topology.world_size)
    elif strategy is Strategy.USP:
        degree = usp_degree(parallel.ulysses_degree, topology, shape)
        plan = plan_ulysses_ring(lengths, topology, tokens_per_rank, degree)
    else:
        raise PlacementError(
            f"parallel.strategy={strategy.value} places whole sequences from packed bins; "
            "use plan_from_bins"
        )
    plan.validate()
    return plan


def plan_from_bins(
    lengths: Sequence[int] | np.ndarray,
    bins: list[list[int]],
    topology: Topology,
    tokens_per_rank: int,
    strategy: str,
) -> AttentionPlan:
    """Plan of whole sequences on given ranks (`bins[r]` lists rank r's sequences).

    The plans of `single` (one bin, one rank) and `dp` (rank-packed bins).
    """
    started = time.perf_counter()
    lengths = np.asarray(lengths, dtype=np.int64)
    rank_of = {seq: rank for rank, group in enumerate(bins) for seq in group}
    if sorted(rank_of) != list(range(len(lengths))):
        raise PlacementError(f"{strategy}: bins must hold every sequence exactly once")
    placements = tuple(
        local_placement(seq, int(n), rank_of[seq]) for seq, n in enumerate(lengths.tolist())
    )
    plan = AttentionPlan(strategy, topology, tokens_per_rank, placements)
    plan.planner_seconds = time.perf_counter() - started
    plan.validate()
    return plan
