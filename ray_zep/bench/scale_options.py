"""`bench scale`'s options for one row: the activation checkpointing that fits, with the
blocks kept sharded over the node after their forward where that fits too
(`parallel.reshard_to_node`), and each batch's step bound under the option kept.

Every option that fits is simulated and the row keeps the fastest (`ray_zep.bench.scale`).
Keeping the node's shards costs 1/G of every block from its forward to its backward; where
the plans' fullest rank fits them under the lightest checkpointing that fits without, they
are the only options (the backward's gather leaves the NICs for nothing recomputed); where
they need more recomputation, both are played. The bound counts the backward's gather
where the option makes it (over the node's links, or over every rank's).
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
    checkpointing_label,
    fitting_options,
    plans_peak,
)
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel


def fitting_checkpointing(config: Config, hardware: Hardware, run: RunModel, stats):
    """`fitting_options` by the fullest rank of every plan of `stats` (per batch): each
    option's config and that rank's modelled bytes. Where `parallel.reshard_to_node` is
    unset and means something, the options keeping the blocks sharded over the node
    after their forward that fit too: alone where the lightest of them recomputes no more
    than the lightest without them, else beside those (the step keeps the fastest)."""
    plans = [one for batch in stats for one in batch]
    peak_of = plans_peak(plans, hardware, run.shape)
    unset = config.parallel.reshard_to_node is None
    if not (unset and node_reshard_applies(config, hardware.topology)):
        return fitting_options(config, hardware, run, peak_of)
    apart = fitting_options(with_node_shards(config, False), hardware, run, peak_of)
    together = fitting_options(with_node_shards(config, True), hardware, run, peak_of)
    together = [(c, peak) for c, peak in together if peak <= hardware.usable_memory_bytes]
    if together and checkpointing_label(together[0][0], run.shape) == checkpointing_label(
        apart[0][0], run.shape
    ):
        return together
    return apart + together


def as_option(config: Config, option: Config) -> Config:
    """`config` under `option`'s activation checkpointing and `parallel.reshard_to_node`."""
    return with_node_shards(checkpointing_as(config, option), option.parallel.reshard_to_node)


def bounds_by_node_shards(batches: list[np.ndarray], run: RunModel) -> dict:
    """Each batch's step bound under each `parallel.reshard_to_node` the row may run, keyed
    by it (the bound counts the backward's gather where the run makes it): the config's
    own where it is set or means nothing, else both."""
    config = run.config
    own = config.parallel.reshard_to_node
    if own is not None or not node_reshard_applies(config, run.hardware.topology):
        return {own: [step_bound(b, run) for b in batches]}
    return {on: [step_bound(b, dataclasses.replace(run, config=with_node_shards(config, on)))
                 for b in batches]
            for on in (False, True)}  # fmt: skip


def own_bounds(bounds: dict, option: Config) -> list:
    """`bounds_by_node_shards`' bounds for the option a row keeps (one where the key
    means nothing or is unset counts the gather over every rank, as it runs)."""
    flag = option.parallel.reshard_to_node
    if flag in bounds:
        return bounds[flag]
    return bounds.get(bool(flag), next(iter(bounds.values())))
