"""`bench scale`'s options for one row: with the blocks kept sharded over the node after
their forward or not (`parallel.reshard_to_node`, unset: both are played, each planned and
simulated with the memory it leaves, and the row keeps the faster), the activation
checkpointing that fits, and each batch's step bound under the option kept: the bound
counts the backward's gather where the option makes it (over the node's links, or over
every rank's).
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
    """`config` under `option`'s activation checkpointing and `parallel.reshard_to_node`."""
    return with_node_shards(checkpointing_as(config, option), option.parallel.reshard_to_node)


def bounds_by_node_shards(batches: list[np.ndarray], run: RunModel) -> dict:
    """Each batch's step bound under each `parallel.reshard_to_node` the row may run
    (`node_shard_choices`), keyed by it: the bound counts the backward's gather where the
    run makes it."""
    config = run.config
    return {on: [step_bound(b, dataclasses.replace(run, config=with_node_shards(config, on)))
                 for b in batches]
            for on in node_shard_choices(config, run.hardware.topology)}  # fmt: skip


def own_bounds(bounds: dict, option: Config) -> list:
    """`bounds_by_node_shards`' bounds for the option a row keeps (one where the key
    means nothing or is unset counts the gather over every rank, as it runs)."""
    flag = option.parallel.reshard_to_node
    if flag in bounds:
        return bounds[flag]
    return bounds.get(bool(flag), next(iter(bounds.values())))
