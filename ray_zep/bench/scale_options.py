"""`bench scale`'s options for one row: fsdp over one shard group or over groups of the
nodes whose collectives the cost model times fastest (`parallel.shard_nodes`, unset: both
are played), with the blocks kept sharded over the node after their forward or not
(`parallel.reshard_to_node`, unset: both), each planned and simulated with the memory it
leaves, the row keeping the fastest; the activation checkpointing that fits; and each
batch's step bound under the option kept: the bound counts the groups' collectives and
the backward's gather where the option makes it (over the node's links, or over the
group's).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ray_zep.config import Config
from ray_zep.partition.node_reshard import with_node_shards
from ray_zep.run_memory import node_reshard_applies
from ray_zep.sim.bound import step_bound
from ray_zep.sim.checkpointing import (
    checkpointing_as,
    fitting_options,
    plans_peak,
)
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel
from ray_zep.sim.weights import grouped_shard_nodes


def shard_node_choices(run: RunModel) -> tuple[int, ...]:
    """The `parallel.shard_nodes` values a row is played under: the config's own and, where
    it runs fsdp over one group of every node and the cost model times a smaller group's
    collectives shorter (`grouped_shard_nodes`), that group too (each planned with the
    memory its optimizer state leaves)."""
    parallel, shape = run.config.parallel, run.shape
    grouped = grouped_shard_nodes(parallel, shape, run.hardware.cost(shape), run.element_bytes)
    return (parallel.shard_nodes, grouped) if grouped else (parallel.shard_nodes,)


def weights_choices(run: RunModel) -> list[tuple[int, bool | None]]:
    """Every (`parallel.shard_nodes`, `parallel.reshard_to_node`) a row is played under."""
    topology = run.hardware.topology
    return [(shard, flag) for shard in shard_node_choices(run)
            for flag in node_shard_choices(with_shard_nodes(run.config, shard),
                                           topology)]  # fmt: skip


def with_weights_choice(config: Config, choice: tuple[int, bool | None]) -> Config:
    """`config` under one of `weights_choices`."""
    shard, flag = choice
    return with_node_shards(with_shard_nodes(config, shard), flag)


def with_shard_nodes(config: Config, shard_nodes: int) -> Config:
    """`config` with `parallel.shard_nodes` set to `shard_nodes`."""
    parallel = dataclasses.replace(config.parallel, shard_nodes=shard_nodes)
    return dataclasses.replace(config, parallel=parallel)


def node_shard_choices(config: Config, topology) -> tuple[bool | None, ...]:
    """The `parallel.reshard_to_node` values a row is played under: the config's own where it
    is set or means nothing, else without the node's shards and with them (each planned
    with the memory it leaves: the ring K/V a plan keeps shrinks by the shards)."""
    own = config.parallel.reshard_to_node
    if own is not None or not node_reshard_applies(config, topology):
        return (own,)
    return (False, True)


def fitting_checkpointing(config: Config, hardware: Hardware, run: RunModel, stats):
    """`fitting_options` by the fullest rank of every plan of `stats` (per batch): each
    option's config and that rank's modelled bytes."""
    plans = [one for batch in stats for one in batch]
    return fitting_options(config, hardware, run, plans_peak(plans, hardware, run.shape))


def as_option(config: Config, option: Config) -> Config:
    """`config` under `option`'s activation checkpointing, `parallel.shard_nodes` and
    `parallel.reshard_to_node`."""
    choice = (option.parallel.shard_nodes, option.parallel.reshard_to_node)
    return with_weights_choice(checkpointing_as(config, option), choice)


def bounds_by_choice(batches: list[np.ndarray], run: RunModel) -> dict:
    """Each batch's step bound under each of `weights_choices`, keyed by it: the bound
    counts the backward's gather where the run makes it, and the groups' collectives."""

    def bounds(choice) -> list:
        chosen = dataclasses.replace(run, config=with_weights_choice(run.config, choice))
        return [step_bound(batch, chosen) for batch in batches]

    return {choice: bounds(choice) for choice in weights_choices(run)}


def own_bounds(bounds: dict, option: Config) -> list:
    """`bounds_by_choice`' bounds for the option a row keeps (a `parallel.reshard_to_node`
    that means nothing or is unset counts the gather over every rank, as it runs)."""
    shard, flag = option.parallel.shard_nodes, option.parallel.reshard_to_node
    for key in ((shard, flag), (shard, bool(flag))):
        if key in bounds:
            return bounds[key]
    return next(iter(bounds.values()))
