"""Sequence partitioners: every placement of a global batch as an AttentionPlan.

Each placement is one spec (`spec.PlacementSpec`: traits, planner, layouts, simulator
variants, bench listings) in one table (`registry`); how a group of ranks cuts a
sequence is one layout object (`layout`). A new placement is one module plus one
line in `registry.BUILT_IN` (three with a new chunking: its `Layout` subclass may
live in the same module); see `registry` for one defined outside the package.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ray_zep.config import ParallelConfig
from ray_zep.errors import PlacementError
from ray_zep.model_shapes import ModelShape
from ray_zep.parallel.axes import Placement
from ray_zep.partition.plan import AttentionPlan, local_placement
from ray_zep.partition.registry import planned, spec_of
from ray_zep.partition.shared_plans import shared_plan
from ray_zep.topology import Topology

PLANNED = planned()
"""The built-in placements whose planner computes the placement from the lengths alone."""


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

    Inside `shared_plans.sharing_plans()`, a planner that declares the fields it reads
    gives one plan to every call that agrees on them (the same object).

    Raises:
        PlacementError: the batch does not fit, or the placement needs bins.
        ConfigError: Ulysses head rules fail.
    """
    spec = spec_of(placement)
    planner = spec.planner
    if planner is None:
        raise PlacementError(
            f"parallel.sequence={placement.value} places whole sequences from packed bins; "
            "use plan_from_bins"
        )
    parallel = parallel or ParallelConfig(sequence=placement)
    lengths = np.asarray(lengths, dtype=np.int64)

    def make() -> AttentionPlan:
        plan = planner(lengths, topology, tokens_per_rank, shape, parallel)
        plan.validate()
        return plan

    return shared_plan(placement, spec.reads, lengths, topology, tokens_per_rank, shape,
                       parallel, make)  # fmt: skip


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
