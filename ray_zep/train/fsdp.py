"""Weight sharding with torch's FSDP2 (`parallel.weights=fsdp|hsdp`).

`shard_model` applies `fully_shard` to the embedding, to every transformer block,
to the head (final norm and output) and then to the whole model, over a DeviceMesh
that is a view of the groups `ray_zep.distributed` built: `fsdp` shards over all ranks
(or groups of `parallel.shard_nodes` nodes, replicas across the groups), `hsdp` over the
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

With `parallel.prefetch`, each unit gathers the next `parallel.prefetch_depth` units
in forward and as many before it in backward while it computes; under
`parallel.prefetch_after_attention` (resolved by `ray_zep.prefetch_plan` where unset) a
block gathers the unit that many ahead once its attention has run, so that the gather
and the ring's K/V do not meet on the NICs (`gather_after_attention`).

`parallel.fsdp_unit=linear` also makes each projection of a dense block a unit
of its own, the block's unit keeping its norms. A block unit holds the block's
unsharded parameters and its unsharded gradients together until its
reduce-scatter; a projection unit holds one projection's.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from ray_zep.collectives.adaptive import AdaptiveCollectives
from ray_zep.config import FsdpUnit, ParallelConfig
from ray_zep.distributed import Comm, MeshShape
from ray_zep.errors import ConfigError
from ray_zep.moe.layer import MoE
from ray_zep.parallel.axes import Sharding
from ray_zep.train.fsdp_comms import switch_collectives

try:  # a per-parameter mesh for `shard_placement_fn`: torch > 2.11 (absent from 2.11.0)
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )
except ImportError:  # older torch: fsdp / hsdp train, expert-sharded FSDP units do not
    FSDPMeshInfo = ShardPlacementResult = None

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
            (`ray_zep.train.fsdp_comms`).

    Returns:
        The FSDP modules in forward order (embedding, each block followed by its
        projection units, head), the root last.
        Separate units let backward free the head before the blocks run and gather
        the embedding only at its end, so at most one unit (1 + `parallel.prefetch_depth`
        with prefetch) is gathered at a time.
    """
    mesh = comm.groups.fsdp_mesh(device.type)
    policy = MixedPrecisionPolicy(
        param_dtype=dtype if dtype != torch.float32 else None,
        reduce_dtype=torch.float32 if dtype != torch.float32 else None,
    )
    reshard = parallel.reshard_after_forward
    if reshard and parallel.reshard_to_node:  # resolved by the caller (`reshards_to_node`)
        reshard = comm.topology.gpus_per_node  # FSDP2 reshards to consecutive ranks: a node
    expert_ids = {id(p) for m in expert_modules for p in m.parameters()}
    expert_mesh = comm.groups.expert_mesh(device.type)
    placement = ignored = None
    if expert_ids and expert_mesh is None:
        ignored = {p for m in expert_modules for p in m.parameters()}
    elif expert_ids:
        if ShardPlacementResult is None:
            raise ConfigError(
                f"config key parallel.ep with parallel.weights={parallel.weights.value}: sharding "
                f"experts over their own mesh needs a newer torch than {torch.__version__} "
                "(fully_shard's per-parameter mesh, ShardPlacementResult)"
            )
        # the per-parameter mesh of fully_shard (documented there for MoE experts)
        on_replicas = ShardPlacementResult(Shard(0), FSDPMeshInfo(expert_mesh, shard_mesh_dim=0))

        def placement(param: nn.Parameter) -> ShardPlacementResult | None:
            return on_replicas if id(param) in expert_ids else None

    def wrap(module, reshard_after=reshard, **kwargs) -> FSDPModule:
        return fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after,
                           mp_policy=policy, **kwargs)  # fmt: skip

    embedding = wrap(model.tok_embeddings)
    nested = {}  # each block's unit: its projections' units
    for block in model.layers:
        # inner units first: fully_shard nests from the leaves up
        inner = [wrap(m) for m in projections(block, parallel.fsdp_unit)]
        nested[wrap(block, shard_placement_fn=placement, ignored_params=ignored)] = inner
    blocks = list(nested)
    # the head stays gathered after forward: backward needs it first
    wrap([model.norm, model.output], reshard_after=False)
    head = model.norm  # one unit over both modules: either one stands for it
    root = wrap(model, reshard_after=False, ignored_params=ignored)
    units = [embedding, *blocks, head]
    every = [embedding, *(u for b in blocks for u in (b, *nested[b])), head]
    for module in [*every, root]:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    if parallel.prefetch:
        _set_prefetch(units, nested, bool(parallel.prefetch_after_attention),
                      parallel.prefetch_depth or 1)  # fmt: skip
    if collectives is not None:
        switch_collectives([*every, root], collectives)
    return [*every, root]


PROJECTIONS = tuple(
    f"{half}.{name}"
    for half, names in (("attention", "wq wk wv wo"), ("feed_forward", "w1 w3 w2"))
    for name in names.split()
)
"""A dense block's projections in the order its forward calls them."""


def projections(block: nn.Module, unit: FsdpUnit) -> list[nn.Module]:
    """The modules of `block` that are FSDP2 units of their own, in forward order."""
    if unit is FsdpUnit.BLOCK or isinstance(block.feed_forward, MoE):
        return []
    return [block.get_submodule(name) for name in PROJECTIONS]


def _set_prefetch(
    units: list[FSDPModule],
    inner: dict[FSDPModule, list[FSDPModule]],
    after_attention: bool = False,
    depth: int = 1,
) -> None:
    """Explicit prefetch: each unit gathers the next `depth` units in forward and the
    `depth` before it in backward (FSDP2 skips a unit already gathered or gathering, so
    each gathers once, `depth` units ahead); a block also gathers its first (forward) or
    last (backward) projection. `after_attention`: a block without projection units
    gathers the unit `depth` ahead once its attention has run (`gather_after_attention`),
    not when it starts; the nearer ones were gathered by the units before it.

    Projections prefetch only inside their block: a checkpointed block runs their
    forward again in backward, and a link to the next block would gather, after its
    backward, parameters nothing frees before the optimizer changes them.
    """
    forward = {u: units[i + 1 : i + 1 + depth] for i, u in enumerate(units)}
    backward = {u: units[max(0, i - depth) : i][::-1] for i, u in enumerate(units)}
    for i, unit in enumerate(units):
        if after_attention and not inner.get(unit) and _output_projection(unit):
            if i + depth < len(units):
                gather_after_attention(unit, units[i + depth])
            forward[unit] = []
    for block, chain in inner.items():
        if not chain:
            continue
        forward[block].insert(0, chain[0])
        backward[block].insert(0, chain[-1])
        for earlier, later in itertools.pairwise(chain):
            earlier.set_modules_to_forward_prefetch([later])
            later.set_modules_to_backward_prefetch([earlier])
    for unit in units:
        unit.set_modules_to_forward_prefetch(forward[unit])
        unit.set_modules_to_backward_prefetch(backward[unit])


def _output_projection(unit: nn.Module) -> nn.Module | None:
    """A transformer block's attention output projection (None: `unit` is no block)."""
    attention = getattr(unit, "attention", None)
    return getattr(attention, "wo", None)


def gather_after_attention(block: FSDPModule, later: FSDPModule) -> None:
    """`block`'s forward gathers `later`'s parameters when its attention output
    projection starts: after the attention engine, whose ring K/V then have the NICs to
    themselves, and while the output projection and feed-forward compute. FSDP2 waits
    for the gather in `later`'s pre-forward. Only in a forward that `block` itself was
    called for: a checkpointed block's forward run again in backward (through its inner
    forward, not `block`'s) gathers nothing, as FSDP2's own prefetch does not then."""
    armed = [False]

    def arm(*_) -> None:
        armed[0] = True

    def gather(*_) -> None:
        if armed[0]:
            armed[0] = False
            later.unshard(async_op=True)

    block.register_forward_pre_hook(arm)
    _output_projection(block).register_forward_pre_hook(gather)


def mesh_shape(parallel: ParallelConfig) -> MeshShape | None:
    """The FSDP mesh a weights mode shards over (None: no FSDP): fsdp's shard groups of
    `parallel.shard_nodes` nodes make it (replicate, shard) as hsdp's nodes do."""
    axis = parallel.weights_axis
    if not axis.fsdp:
        return None
    if axis.sharding is Sharding.ALL_RANKS and parallel.shard_nodes:
        return MeshShape.NODE
    return MESH_SHAPES.get(axis.sharding)
