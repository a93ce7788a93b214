"""FSDP2's shard groups: the consecutive ranks that split a unit's parameters, gradients
and optimizer state among them, each group a replica of the others.

`fsdp` shards over every rank (one group) unless `parallel.shard_nodes` names a group of
that many nodes; `hsdp` over each node's GPUs. Where there are several groups the
trainer builds torch's (replicate, shard) mesh (`ray_zep.distributed.groups`): each
block is gathered and reduce-scattered inside its group, and each reduced shard is then
all-reduced with its replicas, the rank at the same place in every other group. The
memory model (`ray_zep.parallel.memory`), the simulator (`ray_zep.sim.weights`), the
prefetch rules (`ray_zep.prefetch_plan`) and the traffic count (`ray_zep.traffic`) all
take the group's size from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ray_zep.errors import ConfigError
from ray_zep.parallel.axes import Sharding
from ray_zep.topology import Topology

if TYPE_CHECKING:
    from ray_zep.config import ParallelConfig


def shard_ranks(sharding: Sharding, shard_nodes: int, topology: Topology,
                ranks: int | None = None) -> int:  # fmt: skip
    """Ranks in one shard group of a run of `ranks` processes (default: one per GPU of
    `topology`): a node's GPUs under `Sharding.NODE`, `shard_nodes` nodes' (0: every
    rank) under `Sharding.ALL_RANKS`; every rank for modes that do not shard by groups.

    Raises:
        ConfigError: `shard_nodes` does not divide the topology's nodes.
    """
    ranks = topology.world_size if ranks is None else ranks
    if sharding is Sharding.NODE:
        return min(topology.gpus_per_node, ranks)
    if sharding is Sharding.ALL_RANKS and shard_nodes:
        if topology.nodes % shard_nodes:
            raise ConfigError(
                f"config key parallel.shard_nodes={shard_nodes}: must divide topology.nodes="
                f"{topology.nodes} (each shard group whole nodes)"
            )
        return min(shard_nodes * topology.gpus_per_node, ranks)
    return ranks


def run_shard_ranks(parallel: ParallelConfig, topology: Topology, ranks: int | None = None) -> int:
    """`shard_ranks` of a run's weights mode and `parallel.shard_nodes`."""
    return shard_ranks(parallel.weights_axis.sharding, parallel.shard_nodes, topology, ranks)


def shard_groups(size: int, world: int) -> tuple[tuple[int, ...], ...]:
    """The shard groups of `size` consecutive ranks each over `world` ranks."""
    return tuple(tuple(range(first, first + size)) for first in range(0, world, size))


def replica_groups(size: int, world: int) -> tuple[tuple[int, ...], ...]:
    """For each place in a shard group of `size`, the ranks at that place in every group
    (the groups a reduced shard is all-reduced over)."""
    return tuple(tuple(range(offset, world, size)) for offset in range(size))
