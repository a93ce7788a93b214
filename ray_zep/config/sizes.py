"""Rules of a config against the sizes of its topology and model, checked before any
process starts.

`check_run` is every such rule: `ray-zep train` applies it before it touches a cluster
and `ray-zep config` before it prints, so a config that one prints the other runs. The
checks that need a live cluster (its free CPUs and GPUs, the nodes it has now) stay
with the driver.

This module sits above `ray_zep.topology` (which names the schema), so the package's
`__init__` does not import it: use `from ray_zep.config.sizes import check_run`.
"""

from __future__ import annotations

from ray_zep.config.schema import Config
from ray_zep.config.training import batch_budget
from ray_zep.errors import ConfigError, TopologyError
from ray_zep.model_shapes import build_shape
from ray_zep.options import Packing
from ray_zep.parallel.axes import Family, Sharding, WeightsMode
from ray_zep.parallel.shard_groups import shard_ranks
from ray_zep.topology import Topology, build_topology


def check_run(config: Config) -> Topology:
    """Every rule of `config` that depends on its topology's and model's sizes.

    Returns:
        The topology `config.topology` describes.

    Raises:
        TopologyError: the topology section contradicts its preset, or `ray.num_workers`
            is not the number of processes the placement runs on it.
        ConfigError: a size rule fails (`check_sizes`), `ray.min_nodes` exceeds
            `topology.nodes`, or an elastic run cannot continue on its fewest nodes
            (`check_live_sizes`).
    """
    topology = build_topology(config.topology)
    expected = num_ranks(config, topology)
    wanted = config.ray.num_workers
    if wanted is not None and wanted != expected:
        raise TopologyError(
            f"config key ray.num_workers={wanted}: parallel.sequence="
            f"{config.parallel.sequence.value} on topology.nodes={topology.nodes} x "
            f"topology.gpus_per_node={topology.gpus_per_node} runs {expected} worker(s)"
        )
    check_sizes(config, topology)
    least = least_nodes(config, topology)
    if least < topology.nodes:
        try:
            check_live_sizes(config, topology, least)
        except ConfigError as exc:
            raise ConfigError(f"config key ray.min_nodes={least}: {exc}") from None
    return topology


def num_ranks(config: Config, topology: Topology) -> int:
    """Processes the run needs on the topology: one for the reference, else one per GPU."""
    return config.parallel.sequence_axis.processes(topology.world_size)


def least_nodes(config: Config, topology: Topology) -> int:
    """The fewest nodes the run trains on: `ray.min_nodes` for an elastic run, else all.

    Raises:
        ConfigError: `ray.min_nodes` exceeds `topology.nodes`.
    """
    least = config.ray.min_nodes
    if least is None:
        return topology.nodes
    if least > topology.nodes:
        raise ConfigError(
            f"config key ray.min_nodes={least}: must be at most topology.nodes={topology.nodes}"
        )
    return least


def check_sizes(config: Config, topology: Topology) -> None:
    """The rules of the parallel axes that depend on the cluster's and the model's sizes.

    Raises:
        ConfigError: `parallel.ep` does not divide the ranks or the experts; a
            weight-passing mode has fewer model units than ranks; routed K/V would travel
            compressed on more than two nodes.
    """
    ranks = num_ranks(config, topology)
    shape = build_shape(config.model)
    ep = config.parallel.ep
    if ep > 1 and (ranks % ep or shape.moe_experts % ep):
        raise ConfigError(
            f"config key parallel.ep={ep}: must divide the {ranks} ranks (topology.nodes="
            f"{topology.nodes} x topology.gpus_per_node={topology.gpus_per_node}) and "
            f"model.moe.num_experts={shape.moe_experts}"
        )
    weights = config.parallel.weights_axis
    _check_shard_nodes(config, topology)
    units = shape.n_layers + 2
    if weights.family is Family.WEIGHT_PASSING and units < ranks:
        raise ConfigError(
            f"config key model.n_layers={shape.n_layers}: parallel.weights={weights.name} "
            f"gives each of the {ranks} ranks a shard of whole units, but the model has "
            f"{units} (embedding, {shape.n_layers} blocks, output); use at least "
            f"{ranks - 2} layers or fewer ranks"
        )


def _check_shard_nodes(config: Config, topology: Topology) -> None:
    """`parallel.shard_nodes`: fsdp only, without expert parallelism, whole groups of
    nodes.

    Raises:
        ConfigError: any of those fails.
    """
    parallel = config.parallel
    nodes = parallel.shard_nodes
    if not nodes:
        return
    if parallel.weights is not WeightsMode.FSDP:
        raise ConfigError(
            f"config key parallel.shard_nodes={nodes}: shard groups are for parallel.weights="
            f"fsdp, not {parallel.weights.value} (hsdp's group is one node); set it to 0"
        )
    if parallel.ep > 1:
        raise ConfigError(
            f"config key parallel.shard_nodes={nodes}: with parallel.ep={parallel.ep} the "
            "experts shard over their own replicas of every rank; set it to 0"
        )
    shard_ranks(Sharding.ALL_RANKS, nodes, topology)  # whole groups of nodes, or its error


def check_live_sizes(config: Config, topology: Topology, least: int) -> None:
    """Every composition a run may continue on, with `least` to `topology.nodes` nodes
    left (an elastic worker group), holds; for a check before such a run starts.

    Raises:
        ConfigError: `least` exceeds `topology.nodes`, the reference placement (one
            process) cannot shrink, a size rule fails on fewer nodes, or under budget
            packing a sequence may not fit the fewest nodes' budget.
    """
    if not 1 <= least <= topology.nodes:
        raise ConfigError(
            f"{least} node(s) to continue on: must be in 1..topology.nodes={topology.nodes}"
        )
    if config.parallel.sequence_axis.one_process:
        raise ConfigError(
            f"parallel.sequence={config.parallel.sequence.value} runs one process, which "
            "cannot continue on fewer nodes"
        )
    for nodes in range(least, topology.nodes + 1):
        try:
            check_sizes(config, topology.with_nodes(nodes))
        except ConfigError as exc:
            raise ConfigError(f"on {nodes} node(s): {exc}") from None
    budget = batch_budget(config.data.batch_fill, least * topology.gpus_per_node,
                          config.train.tokens_per_rank)  # fmt: skip
    longest = config.data.max_doc_tokens
    if config.data.packing is Packing.BUDGET and (longest is None or longest > budget):
        raise ConfigError(
            f"config key data.max_doc_tokens={longest}: on {least} node(s) a sequence must "
            f"fit their budget of {budget} tokens (set data.max_doc_tokens <= "
            f"{budget}, or data.packing=rank)"
        )
