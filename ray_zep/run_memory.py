"""The memory model's inputs from a run's config (`ray_zep.parallel.memory` sits below the
config, which reads its axes; this module reads the config and hands the model plain
inputs)."""

from __future__ import annotations

import torch

from ray_zep.config import Compression, Config, Precision
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import Sharding
from ray_zep.parallel.memory import MemoryInputs
from ray_zep.parallel.shard_groups import run_shard_ranks
from ray_zep.prefetch_plan import run_prefetch_depth
from ray_zep.topology import Topology

USABLE_MEMORY_FRACTION = 0.9
"""Share of a GPU's memory a step can fill: the CUDA context, NCCL's buffers and the
caching allocator's fragmentation take the rest (a few GB on an 80 GB GPU)."""


def memory_inputs(
    config: Config,
    topology: Topology,
    tokens: int,
    ring_tokens: int = 0,
    dtype: torch.dtype = torch.float32,
    flash: bool = False,
    on_cpu: bool = True,
    kept_kv_tokens: float = 0.0,
) -> MemoryInputs:
    """What the memory model needs from a run's config for a rank holding `tokens`
    (`on_cpu`: the rank computes on the CPU, as on a virtual topology; `kept_kv_tokens`:
    `MemoryInputs.kept_kv_tokens`). `parallel.reshard_to_node` counts where set true: a
    run resolves it first (`ray_zep.partition.node_reshard`)."""
    parallel = config.parallel
    ranks = parallel.sequence_axis.processes(topology.world_size)
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return MemoryInputs(
        weights=parallel.weights_axis,
        ep=parallel.ep,
        ranks=ranks,
        gpus_per_node=min(topology.gpus_per_node, ranks),
        tokens=tokens,
        ring_tokens=ring_tokens,
        checkpointing=config.train.activation_checkpointing,
        checkpoint_blocks=config.train.checkpoint_blocks,
        checkpoint_rest=config.train.checkpoint_rest,
        compute_bytes=element_bytes,
        flash_kernel=flash,
        on_cpu=on_cpu,
        prefetch=parallel.prefetch,
        prefetch_depth=run_prefetch_depth(
            config, topology, build_shape(config.model), element_bytes
        ),
        fsdp_unit=parallel.fsdp_unit,
        loss_chunk_tokens=config.model.loss_chunk_tokens,
        kept_kv_tokens=kept_kv_tokens,
        micro_batches=config.train.micro_batches,
        reshard_after_forward=parallel.reshard_after_forward,
        reshard_to_node=bool(parallel.reshard_to_node) and node_reshard_applies(config, topology),
        shard_ranks=group_ranks(config, topology),
    )


def group_ranks(config: Config, topology: Topology) -> int:
    """Ranks in one FSDP2 shard group of the run's `fsdp` (`parallel.shard_nodes`;
    `ray_zep.parallel.shard_groups`); 0 for every other weights mode and for one group
    over every rank."""
    parallel = config.parallel
    axis = parallel.weights_axis
    if not (axis.fsdp and axis.sharding is Sharding.ALL_RANKS and parallel.shard_nodes):
        return 0
    ranks = parallel.sequence_axis.processes(topology.world_size)
    size = run_shard_ranks(parallel, topology, ranks)
    return size if size < ranks else 0


def node_reshard_applies(config: Config, topology: Topology) -> bool:
    """FSDP2 over shard groups of several nodes of more than one GPU, resharding after
    forward, its collectives plain: where `parallel.reshard_to_node` means anything
    (hsdp's groups are a node already; compressed, FSDP2's units gather through a switch
    over their shard group, `ray_zep.train.fsdp_comms`, which the node's group is not)."""
    parallel = config.parallel
    axis = parallel.weights_axis
    if not (axis.fsdp and axis.sharding is Sharding.ALL_RANKS and parallel.reshard_after_forward):
        return False
    if config.comm.compression is not Compression.OFF:
        return False
    gpus = topology.gpus_per_node
    group = group_ranks(config, topology) or parallel.sequence_axis.processes(topology.world_size)
    return topology.nodes > 1 and 1 < gpus < group and group % gpus == 0


def memory_precision(config: Config, topology: Topology) -> tuple[torch.dtype, bool, str]:
    """(compute dtype, flash-attn, in words) the memory model assumes for a run of `config`
    on `topology` (GPU presets: bf16, flash-attn)."""
    on_gpu = topology.gpu_memory_bytes > 0
    bf16 = on_gpu and config.train.precision is not Precision.FP32
    flash = on_gpu and bf16 and config.model.attention_kernel != "torch"
    how = ("bf16" if bf16 else "fp32") + (", flash-attn" if flash else ", torch attention")
    return (torch.bfloat16 if bf16 else torch.float32), flash, how
