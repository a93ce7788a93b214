"""Whether a run keeps its FSDP2 units sharded over the node after their forward
(`parallel.reshard_to_node`).

FSDP2 over every rank frees a unit's gathered parameters after its forward and gathers
them again over every rank for its backward: on a cluster of several nodes that second
gather crosses the NICs while the rings' dK/dV and the gradients' reduce-scatter need
them. Resharded to the node's G GPUs instead (FSDP2's `reshard_after_forward=G`), each
rank keeps 1/G of every unit from its forward until its backward and the backward's
gather stays on the node's own links. Unset, the key is true where the topology names
its GPU's memory and the memory model finds room for those shards at L tokens a rank,
all of them in rings (the fullest rank a plan may make); a rank's modelled peak then
counts them (`ray_zep.partition.plan_memory.rank_memory`: the planner's ring K/V room, the
plan's memory, the trainer's accounting). `bench scale` plays each row with them and
without, each planned with the memory it leaves, and keeps the faster.
"""

from __future__ import annotations

import dataclasses

from ray_zep.config import Compression, Config
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import ModelShape, build_shape
from ray_zep.parallel.memory import model_memory
from ray_zep.run_memory import (
    USABLE_MEMORY_FRACTION,
    memory_inputs,
    memory_precision,
    node_reshard_applies,
)
from ray_zep.topology import Topology


def with_node_shards(config: Config, on: bool) -> Config:
    """`config` with `parallel.reshard_to_node` set to `on`."""
    parallel = dataclasses.replace(config.parallel, reshard_to_node=on)
    return dataclasses.replace(config, parallel=parallel)


def reshards_to_node(config: Config, topology: Topology, shape: ModelShape | None = None) -> bool:
    """`parallel.reshard_to_node` for a run of `config` on `topology` (module docstring):
    false where it does not apply, the key where set, else whether the shards fit.

    Raises:
        ConfigError: the key is true and `comm.compression` on (`node_reshard_applies`)."""
    parallel = config.parallel
    if not node_reshard_applies(config, topology):
        if parallel.reshard_to_node and config.comm.compression is not Compression.OFF:
            raise ConfigError(
                f"config key parallel.reshard_to_node=true with comm.compression="
                f"{config.comm.compression.value}: FSDP2's compressed collectives run over the "
                "shard group only, not the node's; set parallel.reshard_to_node=false or "
                "comm.compression=off"
            )
        return False
    if parallel.reshard_to_node is not None:
        return parallel.reshard_to_node
    if topology.gpu_memory_bytes <= 0:
        return False
    shape = shape or build_shape(config.model)
    capacity = config.train.tokens_per_rank
    dtype, flash, _ = memory_precision(config, topology)
    kept = memory_inputs(with_node_shards(config, True), topology, capacity, capacity, dtype,
                         flash, on_cpu=False)  # fmt: skip
    return model_memory(shape, kept).total <= USABLE_MEMORY_FRACTION * topology.gpu_memory_bytes
