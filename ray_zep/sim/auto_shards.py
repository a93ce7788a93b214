"""`plan --auto`'s shard-group phase: the fastest fitting composition, where it runs fsdp
over one group of every node, played again over shard groups of the nodes whose
collectives the cost model times fastest (`parallel.shard_nodes`,
`ray_zep.sim.weights.grouped_shard_nodes`). Over 1,024 GPUs of cluster A a gather over
every rank waits 4 ms on its ring steps, over 128 ranks 0.5 ms; each rank then keeps 1/G
more optimizer state, which the memory model counts and the token room pays for, so the
phase plays the groups rather than choosing them by the collectives alone."""

from __future__ import annotations

import dataclasses

from ray_zep.config import Config
from ray_zep.sim.auto_ranking import AutoPlan, Candidate
from ray_zep.sim.checkpointing import checkpointing_as
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel
from ray_zep.sim.weights import grouped_shard_nodes


def shard_group_twin(
    plan: AutoPlan, config: Config, hardware: Hardware
) -> tuple[Config, Candidate] | None:
    """(the composition to play, the candidate it is the twin of): the fastest fitting
    candidate of `plan` over its fastest shard groups, under `config`'s activation
    checkpointing (as the other phases after the groups); None where that candidate is not
    fsdp over one group or one group is fastest."""
    fitting = [c for c in plan.ranked if c.steps and c.fits]
    if not fitting:
        return None
    best = fitting[0]
    run = RunModel.create(best.config, hardware)
    cost = hardware.cost(run.shape)
    nodes = grouped_shard_nodes(best.config.parallel, run.shape, cost, run.element_bytes)
    if not nodes:
        return None
    twin = checkpointing_as(best.config, config)
    grouped = dataclasses.replace(twin.parallel, shard_nodes=nodes)
    return dataclasses.replace(twin, parallel=grouped), best
