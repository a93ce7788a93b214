"""What the weights axis adds to a simulated step: collectives, their overlap, the optimizer.

As the trainer runs each mode (`ray_zep.train.fsdp`, `ray_zep.train.reductions`):

- replicated: every rank holds every parameter; the gradients are all-reduced in
  float32 once after backward (not overlapped), and every rank updates all of them.
- fsdp / hsdp: torch's FSDP2 over all ranks / inside each node. Each block is one
  unit: in forward the next block's parameters are all-gathered while this block
  computes (FSDP2 queues the next unit's all-gather as the host runs ahead; torch
  `_fully_shard/_fsdp_param_group.py`), from when its attention is done under
  `parallel.prefetch_after_attention` (`LayerSetup.gather_after_attention`), from
  when it starts otherwise, and again in backward
  (`reshard_after_forward`), where the block's gradients are also reduce-scattered
  while the next block computes backward (under `parallel.reshard_to_node` that gather
  runs over the block's shards on the node's GPUs: the simulator plays it on the
  reduce-scatter's links, after it, as one collective: on the NICs too, for its own few
  milliseconds). With `parallel.prefetch_depth` 2 or more a
  block's gather is posted that many blocks ahead (`gathered_ahead`): in forward and
  backward alike it may run past the end of the block that posts it, into the next one,
  where it shares the links with that block's messages; the backward's reduce-scatter
  is still waited for within its block
  (`ray_zep.sim.graph_builder.LayerSetup.gathered_ahead`). Parameters travel in the
  compute dtype (`MixedPrecisionPolicy.param_dtype`), gradients are reduced in float32. What
  cannot overlap: the first gathers (embedding, first block, the head, which stays
  gathered after forward) and the last reduce-scatters after backward. hsdp (and fsdp
  over shard groups of `parallel.shard_nodes` nodes) adds, per block, the all-reduce of
  each rank's reduced shard with its replicas in the other groups, which FSDP2 runs on
  its own stream right after the block's reduce-scatter while the next block computes
  backward (torch `_fully_shard/_fsdp_collectives.py`, `foreach_reduce`): the G ranks
  of a node all-reduce at once over its NICs, and the last block's, the embedding's and
  the head's are exposed. Each rank updates only its shard.

With `comm.compression` (`ray_zep.sim.wire.WireCodec`), FSDP2's all-gathers
(`fsdp_all_gather`, in the parameters' dtype) and reduce-scatters
(`fsdp_reduce_scatter`, float32) and the replicated gradient all-reduce
(`gradients`, float32) go zipped where the mode zips them; hsdp's all-reduce across
nodes is FSDP2's own and stays plain, as in the trainer.

Weight-passing modes are simulated by `ray_zep.sim.weight_passing`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_zep.collectives.switcher import Kind
from ray_zep.config import ParallelConfig
from ray_zep.costmodel import GRAD_BYTES_PER_ELEMENT, CostModel
from ray_zep.model_shapes import ModelShape
from ray_zep.options import CompressionStream
from ray_zep.parallel.axes import WEIGHTS_AXES, Sharding, WeightsMode
from ray_zep.parallel.memory import mean_block_params
from ray_zep.parallel.shard_groups import shard_groups, shard_ranks
from ray_zep.sim.wire import PLAIN, Stream, WireCodec
from ray_zep.topology import Topology

SCATTER = Stream(CompressionStream.FSDP_REDUCE_SCATTER.value, GRAD_BYTES_PER_ELEMENT, True)
GRADIENTS = Stream(CompressionStream.GRADIENTS.value, GRAD_BYTES_PER_ELEMENT, True)


@dataclass(frozen=True)
class WeightsCost:
    """Seconds the weights mode adds to a step.

    Attributes:
        layer_sync: a block's collectives (forward, backward), overlapped with the
            block's compute (`ray_zep.sim.graph_builder.LayerSetup.weight_sync`).
        groups: the rank groups those collectives run over.
        backward_groups: the backward's groups where they differ (hsdp across nodes:
            every rank, its all-reduce crossing every node's NICs); empty: `groups`.
        layer_latency: the ring steps' latency within `layer_sync` (links idle for it).
        exposed: collectives no compute hides (before the first block, after the last).
        owned_params: parameters each rank updates.
        gathered_ahead: the blocks' gathers are posted two or more blocks ahead
            (`parallel.prefetch_depth`), so a layer waits only for the one posted
            before it (`ray_zep.sim.graph_builder.LayerSetup.gathered_ahead`).
        regather_in_node: the backward gathers each block again over its node's GPUs
            (`parallel.reshard_to_node`); `layer_sync`'s backward holds that gather.
        blocks_ahead: how many blocks ahead a block's gather is posted (1 where there
            are no per-block collectives): how far ranks may run ahead of one another
            (`ray_zep.sim.drift`).
    """

    layer_sync: tuple[float, float] = (0.0, 0.0)
    groups: tuple[tuple[int, ...], ...] = ()
    exposed: float = 0.0
    owned_params: float = 0.0
    layer_latency: tuple[float, float] = (0.0, 0.0)
    backward_groups: tuple[tuple[int, ...], ...] = ()
    gathered_ahead: bool = False
    regather_in_node: bool = False
    blocks_ahead: int = 1


def _groups(
    topology: Topology, sharding: Sharding, shard_nodes: int
) -> tuple[tuple[int, ...], ...]:
    world = topology.world_size
    return shard_groups(shard_ranks(sharding, shard_nodes, topology), world)


def weights_cost(
    mode: WeightsMode,
    shape: ModelShape,
    cost: CostModel,
    param_bytes: int,
    reshard: bool = True,
    host_seconds: float = 0.0,
    codec: WireCodec = PLAIN,
    ahead: int = 1,
    in_node: bool = False,
    shard_nodes: int = 0,
) -> WeightsCost:
    """The cost of `mode` for `shape` on `cost`'s topology; parameters gathered in
    `param_bytes` per element, gradients reduced in float32, each zipped where `codec`
    zips it; FSDP2's host work of a step (`host_seconds`: its units times
    `ComputeRates.fsdp_unit_overhead_s`) counts as exposed; blocks gathered `ahead`
    blocks before they run (`WeightsCost.gathered_ahead`); resharded, gathered again in
    backward over each node's GPUs where `in_node` (`WeightsCost.regather_in_node`: FSDP
    over every rank of several nodes, as `ray_zep.partition.node_reshard` resolves it);
    fsdp's shard groups of `shard_nodes` nodes (`parallel.shard_nodes`; 0: one group),
    each reduced shard all-reduced with its replicas as hsdp's are.

    Raises:
        ValueError: a weight-passing mode (see `ray_zep.sim.weight_passing`).
    """
    axis = WEIGHTS_AXES[mode]
    topology = cost.topology
    params = shape.param_count()
    if axis.sharding is Sharding.NONE:
        ranks = range(topology.world_size)
        grads = params * GRAD_BYTES_PER_ELEMENT
        plain = cost.all_reduce_seconds(grads, ranks)
        exposed = codec.collective_seconds(plain, cost, ranks, Kind.ALL_REDUCE, GRADIENTS, grads)
        return WeightsCost(exposed=exposed, owned_params=params)
    if not axis.fsdp:
        raise ValueError(f"parallel.weights={mode.value} is simulated by sim.weight_passing")
    groups = _groups(topology, axis.sharding, shard_nodes)
    size = len(groups[0])
    # one block, averaged over dense and MoE blocks (an MoE block holds every expert)
    block = mean_block_params(shape) / size
    embedding = shape.vocab_size * shape.dim / size
    gather_stream = Stream(CompressionStream.FSDP_ALL_GATHER.value, param_bytes)

    def gather_seconds(shard: float) -> float:  # `shard` parameters per rank
        nbytes = shard * param_bytes
        plain = cost.all_gather_seconds(nbytes, groups[0])
        return codec.collective_seconds(
            plain, cost, groups[0], Kind.ALL_GATHER, gather_stream, nbytes
        )

    def scatter_seconds(shard: float) -> float:  # the switcher counts the whole buffer
        plain = cost.all_gather_seconds(shard * GRAD_BYTES_PER_ELEMENT, groups[0])
        full = shard * size * GRAD_BYTES_PER_ELEMENT
        return codec.collective_seconds(plain, cost, groups[0], Kind.REDUCE_SCATTER, SCATTER, full)

    gather, scatter = gather_seconds(block), scatter_seconds(block)
    first, last = gather_seconds(embedding), scatter_seconds(embedding)
    # before the blocks: embedding and first block; the head once (it stays gathered);
    # after them: the last block's, the head's and the embedding's reduce-scatters
    exposed = 2 * first + gather + 2 * last + scatter
    latency = cost.all_gather_seconds(0.0, groups[0])
    again, again_latency = (gather, latency) if reshard else (0.0, 0.0)
    in_node = in_node and reshard
    if in_node:  # each rank holds 1/G of the block: the node's GPUs gather the rest
        node = tuple(topology.ranks_of_node(0))
        nbytes = block * size / len(node) * param_bytes
        plain = cost.all_gather_seconds(nbytes, node)
        again = codec.collective_seconds(plain, cost, node, Kind.ALL_GATHER, gather_stream, nbytes)
        again_latency = cost.all_gather_seconds(0.0, node)
    backward = again + scatter
    latencies = (latency, latency + again_latency)
    backward_groups: tuple[tuple[int, ...], ...] = ()
    if len(groups) > 1:
        # the G shard all-reduces of a node run at once over its NICs: together they move
        # G / size of a block's gradient across nodes (hsdp: all of it), each block's
        # beside the next one's backward
        replicas = [g[0] for g in groups]
        node_share = topology.gpus_per_node * GRAD_BYTES_PER_ELEMENT

        def across(params_each: float) -> float:
            return cost.all_reduce_seconds(params_each * node_share, replicas)

        exposed += across(block + 2 * embedding)  # the last block's, the embedding's, the head's
        backward += across(block)
        latencies = (latencies[0], latencies[1] + across(0.0))
        backward_groups = (tuple(range(topology.world_size)),)
    exposed += host_seconds
    return WeightsCost((gather, backward), groups, exposed, params / size, latencies,
                       backward_groups, ahead > 1, in_node, ahead)  # fmt: skip


def step_collective_seconds(cost: WeightsCost, blocks: int) -> float:
    """The seconds fsdp's collectives take in one step by the cost model, hidden or not:
    each of `blocks` blocks' forward gather and backward collectives, and the gathers
    and reduce-scatters before and after them."""
    return blocks * sum(cost.layer_sync) + cost.exposed


def fastest_shard_nodes(
    shape: ModelShape, cost: CostModel, param_bytes: int, reshard: bool = True
) -> int:
    """The `parallel.shard_nodes` under which fsdp's collectives take the least time a step
    (`step_collective_seconds`) over the divisors of the topology's nodes: a smaller
    group's rings wait on fewer steps, its replicas then all-reduce the reduced shards
    across the groups. 0 where one group over every node is fastest (on 8 nodes of
    cluster A; over 128 nodes a 13B model's are 24% shorter in groups of 16)."""
    nodes = cost.topology.nodes

    def seconds(shard_nodes: int) -> float:
        paid = weights_cost(WeightsMode.FSDP, shape, cost, param_bytes, reshard,
                            shard_nodes=shard_nodes)  # fmt: skip
        return step_collective_seconds(paid, shape.n_layers)

    timed = {k: seconds(k) for k in range(nodes) if k == 0 or nodes % k == 0}
    return min(timed, key=timed.__getitem__)  # one group (0, first) where none is faster


def grouped_shard_nodes(
    parallel: ParallelConfig, shape: ModelShape, cost: CostModel, param_bytes: int
) -> int:
    """The shard groups worth playing beside a run's own (`bench scale`, `plan --auto`):
    `fastest_shard_nodes` where the run is fsdp over one group of every node without
    expert parallelism (the config refuses groups with it), else 0."""
    if parallel.weights is not WeightsMode.FSDP or parallel.shard_nodes or parallel.ep > 1:
        return 0
    return fastest_shard_nodes(shape, cost, param_bytes, parallel.reshard_after_forward)
