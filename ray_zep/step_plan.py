"""One step's plan: where a global batch's tokens go and what the step moves.

`plan_step` decides, for the configured sequence placement, the attention plan
(the planner of `ray_zep.partition`; none where every sequence stays whole on a
rank), the routed ring transfers (`parallel.routing`), the remap to a balanced
linear layout (`parallel.remap`, when its policy pays) and the step's attention
traffic. The data actor cuts the batch into rank shards from it
(`ray_zep.data.shards`); nothing else decides placement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_zep.config import Config, ZonePolicy
from ray_zep.costmodel import preset_rates
from ray_zep.cycle_collection import paused
from ray_zep.model_shapes import ModelShape
from ray_zep.options import DkvWire
from ray_zep.parallel.axes import SEQUENCE_AXES
from ray_zep.partition.plan import AttentionPlan
from ray_zep.partition.plan_memory import memory_plan
from ray_zep.partition.work import WorkModel
from ray_zep.partition.work_bins import work_bins
from ray_zep.remap.policy import choose_remap
from ray_zep.remap.solver import RemapPlan
from ray_zep.routing.routes import RoutingPlan
from ray_zep.topology import Topology
from ray_zep.traffic import Traffic, attention_step_parts


@dataclass(frozen=True)
class StepPlan:
    """How one global batch is placed and moved.

    Attributes:
        attention: the planner's placement; None when sequences stay whole on ranks.
        routing: the routed ring transfers (`parallel.routing`), or None.
        remap: the move to the linear layout (`parallel.remap`), or None.
        traffic: whole-job attention and remap bytes of the step, as
            (bytes per byte of the compute dtype, float32 dK/dV bytes); None when
            attention never communicates.
    """

    attention: AttentionPlan | None = None
    routing: RoutingPlan | None = None
    remap: RemapPlan | None = None
    traffic: tuple[Traffic, Traffic] | None = None

    @property
    def planned(self) -> bool:
        return self.attention is not None


def whole_bins(
    lengths: np.ndarray,
    bins: list[list[int]] | None,
    config: Config,
    topology: Topology,
    shape: ModelShape,
) -> list[list[int]] | None:
    """The ranks' sequences under a whole-sequence placement: the stream's `bins`, dealt
    again by modelled work under `parallel.zone_policy=work` where that fits L
    (`ray_zep.partition.work_bins`)."""
    if bins is None or config.parallel.zone_policy is not ZonePolicy.WORK:
        return bins
    model = WorkModel.create(shape, topology)
    dealt = work_bins(lengths, topology.world_size, config.train.tokens_per_rank, model)
    return dealt if dealt is not None else bins


def plan_step(
    lengths: np.ndarray, config: Config, topology: Topology, shape: ModelShape
) -> StepPlan:
    """The plan of a batch of sequences of `lengths` under `config.parallel`.

    Raises:
        PlacementError: the batch does not fit the placement.
        ConfigError: the placement's rules (e.g. Ulysses head counts) fail.
    """
    parallel = config.parallel
    if SEQUENCE_AXES[parallel.sequence].whole_sequences:
        return StepPlan()
    with paused():  # a plan's objects are freed by reference counting
        return _plan_step(lengths, config, topology, shape)


def _plan_step(
    lengths: np.ndarray, config: Config, topology: Topology, shape: ModelShape
) -> StepPlan:
    parallel = config.parallel
    plan, remap = _placed(lengths, config, topology, shape)
    owner = parallel.dkv_wire is DkvWire.OWNER
    routing = RoutingPlan.build(plan, dkv_owner=owner) if parallel.routing else None
    traffic = attention_step_parts(plan, shape, parallel.routing, remap, owner)
    return StepPlan(plan, routing, remap, traffic)


def plan_placement(
    lengths: np.ndarray, config: Config, topology: Topology, shape: ModelShape
) -> tuple[AttentionPlan, RemapPlan | None]:
    """`plan_step`'s attention plan and remap alone, for a placement that splits sequences
    (the simulator routes on its own and counts its own traffic)."""
    with paused():
        return _placed(lengths, config, topology, shape)


def _placed(
    lengths: np.ndarray, config: Config, topology: Topology, shape: ModelShape
) -> tuple[AttentionPlan, RemapPlan | None]:
    parallel = config.parallel
    plan = memory_plan(parallel.sequence, lengths, config, topology, shape)
    remap = None
    if parallel.remap:
        remap = choose_remap(plan, shape, preset_rates(topology.gpu_model), parallel.remap_policy,
                             parallel.ulysses_pieces)  # fmt: skip
    return plan, remap
