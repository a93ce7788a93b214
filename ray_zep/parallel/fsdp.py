"""Weight sharding with torch's FSDP2 (`parallel.weights=fsdp|hsdp`).

`shard_model` applies `fully_shard` to the embedding, to every transformer block,
to the head (final norm and output) and then to the whole model, over a DeviceMesh
that is a view of the groups `ray_zep.dist` built: `fsdp` shards over all ranks, `hsdp` over the
GPUs of a node with replicas across nodes. Gradients are summed, not averaged
(the loss is already normalised by the global token count), with a plain SUM
reduction because gloo has no pre-multiplied one. On GPU with bf16, parameters
are gathered in bf16 and gradients reduced in fp32 (`MixedPrecisionPolicy`).

Experts split by expert parallelism differ from rank to rank of a block's mesh,
so their parameters are sharded over a mesh of their own, the ranks that hold
the same experts, inside the block's FSDP unit (`shard_placement_fn` with a
per-parameter mesh). One unit per block matters: FoldMoE calls the experts once
per micro-batch, and a separately wrapped experts module would reduce-scatter
once per call, in an order that can differ between ranks. Where every rank holds
other experts (parallel.ep = ranks), FSDP leaves them alone.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import Shard

from ray_zep.collectives.adaptive import AdaptiveCollectives
from ray_zep.config import ParallelConfig
from ray_zep.dist import Comm, MeshShape
from ray_zep.parallel.axes import Sharding
from ray_zep.parallel.fsdp_comms import switch_collectives

MESH_SHAPES = {Sharding.ALL_RANKS: MeshShape.FLAT, Sharding.NODE: MeshShape.NODE}


def shard_model(
    model: nn.Module,
    comm: Comm,
    parallel: ParallelConfig,
    device: torch.device,
    dtype: torch.dtype,
    expert_modules: list[nn.Module] = (),
    collectives: AdaptiveCollectives | None = None,
) -> list[FSDPModule]:
    """Shard `model` in place with FSDP2 (collective: every rank calls it).

    Args:
        model: the Transformer, initialised identically on every rank.
        comm: this rank's Comm, built with FSDP's groups (`GroupNeeds.fsdp`).
        parallel: the weights mode, resharding and prefetch settings.
        device: compute device (its type names the mesh's device type).
        dtype: compute dtype; bf16 gathers parameters in bf16 and reduces in fp32.
        expert_modules: modules holding only expert-parallel weights.
        collectives: the shard group's compression switch (`comm.compression`
            on): the units' all-gathers and reduce-scatters go through it
            (`ray_zep.parallel.fsdp_comms`).

    Returns:
        The FSDP modules in forward order (embedding, blocks, head), the root last.
        Separate units let backward free the head before the blocks run and gather
        the embedding only at its end, so at most one unit (two with prefetch) is
        gathered at a time.
    """
    mesh = comm.groups.fsdp_mesh(device.type, comm.topology)
    policy = MixedPrecisionPolicy(
        param_dtype=dtype if dtype != torch.float32 else None,
        reduce_dtype=torch.float32 if dtype != torch.float32 else None,
    )
    reshard = parallel.reshard_after_forward
    expert_ids = {id(p) for m in expert_modules for p in m.parameters()}
    expert_mesh = comm.groups.expert_mesh(device.type)
    placement = ignored = None
    if expert_ids and expert_mesh is None:
        ignored = {p for m in expert_modules for p in m.parameters()}
    elif expert_ids:
        # the per-parameter mesh of fully_shard (documented there for MoE experts)
        on_replicas = ShardPlacementResult(Shard(0), FSDPMeshInfo(expert_mesh, shard_mesh_dim=0))

        def placement(param: nn.Parameter) -> ShardPlacementResult | None:
            return on_replicas if id(param) in expert_ids else None

    embedding = fully_shard(model.tok_embeddings, mesh=mesh, reshard_after_forward=reshard,
                            mp_policy=policy)  # fmt: skip
    blocks = [
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy,
                    shard_placement_fn=placement, ignored_params=ignored)
        for block in model.layers
    ]  # fmt: skip
    # the head stays gathered after forward: backward needs it first
    fully_shard([model.norm, model.output], mesh=mesh, reshard_after_forward=False,
                mp_policy=policy)  # fmt: skip
    head = model.norm  # one unit over both modules: either one stands for it
    root = fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy,
                       ignored_params=ignored)  # fmt: skip
    units = [embedding, *blocks, head]
    for module in [*units, root]:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    if parallel.prefetch:
        for earlier, later in itertools.pairwise(units):
            earlier.set_modules_to_forward_prefetch([later])
            later.set_modules_to_backward_prefetch([earlier])
    if collectives is not None:
        switch_collectives([*units, root], collectives)
    return [*units, root]


def mesh_shape(parallel: ParallelConfig) -> MeshShape | None:
    """The FSDP mesh a weights mode shards over (None: no FSDP)."""
    return MESH_SHAPES.get(parallel.weights_axis.sharding) if parallel.weights_axis.fsdp else None
