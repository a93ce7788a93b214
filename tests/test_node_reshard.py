"""FSDP2's blocks kept sharded over the node after their forward (`parallel.reshard_to_node`):
the backward gathers them inside the node and trains as one process does; the memory
model counts the node's shards, the simulator and the bound the gather off the NICs;
unset, the memory model decides."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group

from tests.helpers.procs import run_ranks
from tests.helpers.scenarios import zeppelin_case
from tests.helpers.training import SMALL_RUN, train_rank, train_rank_each

REL_TOL = 1e-5
TWO_BY_TWO = [*SMALL_RUN, "topology.nodes=2", "topology.gpus_per_node=2", "train.steps=3",
              "train.checkpoint_every=0"]  # fmt: skip


def gather_sizes(rank: int, world: int, overrides: list[str]) -> list[int]:
    """The group size of every all-gather FSDP2 issues in one training step of `overrides`
    on this rank, in order."""
    sizes: list[int] = []
    issue = param_group.foreach_all_gather

    def noted(fsdp_params, group, *args, **kwargs):
        sizes.append(group.size())
        return issue(fsdp_params, group, *args, **kwargs)

    param_group.foreach_all_gather = noted
    try:
        steps = [o for o in overrides if not o.startswith("train.steps=")]
        train_rank(rank, world, [*steps, "train.steps=1"])
    finally:
        param_group.foreach_all_gather = issue
    return sizes


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@pytest.mark.dist
def test_blocks_kept_on_the_node_gather_there_in_backward_and_train_as_one_process(
    tmp_path: Path,
) -> None:
    """2 nodes x 2 GPUs under FSDP: resharded to the node, the backward's gathers run over
    the node's 2 ranks (over all 4 otherwise), and three steps give one process's losses
    and parameters (the same global batches), as resharding to every rank does."""
    fsdp = [*TWO_BY_TWO, "parallel.weights=fsdp"]
    node, every = ([*fsdp, f"parallel.reshard_to_node={on}"] for on in ("true", "false"))
    runs = [[*run, f"train.out_dir={tmp_path / str(i)}"] for i, run in enumerate((node, every))]
    node_run, every_run = run_ranks(train_rank_each, 4, runs)[0]
    single = run_ranks(train_rank, 1, [*TWO_BY_TWO, "parallel.sequence=single",
                                       f"train.out_dir={tmp_path / 'single'}"])[0]  # fmt: skip
    for what, run in (("node", node_run), ("every rank", every_run)):
        for step, loss in single["losses"].items():
            assert run["losses"][step] == pytest.approx(loss, rel=REL_TOL), (what, step)
        for name, want in single["params"].items():
            assert _relative(run["params"][name], want) <= REL_TOL, (what, name)
    on_node, on_every = (run_ranks(gather_sizes, 4, [*run, f"train.out_dir={tmp_path / name}"])[0]
                         for run, name in ((node, "node once"), (every, "every once")))  # fmt: skip
    assert 2 in on_node and set(on_every) == {4}
    assert on_node.count(2) >= 2  # the blocks' gathers again in backward, on the node


@pytest.mark.unit
def test_the_memory_model_counts_a_node_shard_of_every_block_until_its_backward() -> None:
    """7B on cluster A at 4k tokens: the node's shards add 1/8 of the blocks' parameters in
    bf16 to the peak at the start of backward (1.6 GB), not whole blocks; unset, a rank's
    peak counts them where the run keeps them."""
    from ray_zep.parallel.memory import fsdp_units
    from ray_zep.partition.node_reshard import with_node_shards
    from ray_zep.partition.plan_memory import rank_memory

    config, topology, shape = zeppelin_case(64, "7b", 5120)
    apart, kept = (rank_memory(with_node_shards(config, on), topology, shape, 5120, 5120).total
                   for on in (False, True))  # fmt: skip
    units = fsdp_units(shape, config.parallel.fsdp_unit)
    eighth = sum(units) * 2 / 8
    assert 0.5 * eighth < kept - apart <= eighth
    assert 1.2e9 < kept - apart < 1.7e9
    # unset, the peak is the run's: with the shards where it keeps them (here), else without
    assert rank_memory(config, topology, shape, 5120, 5120).total == kept
    config, topology, shape = zeppelin_case(64, "13b", 40960)
    unset, apart = (rank_memory(one, topology, shape, 40960, 40960).total
                    for one in (config, with_node_shards(config, False)))  # fmt: skip
    assert unset == apart


@pytest.mark.unit
def test_plan_says_where_the_run_keeps_the_node_shards() -> None:
    """`ray-zep plan`'s memory line names the shards where the run keeps them (7B at 4k on
    cluster A, unset) and not where it does not (set false)."""
    import numpy as np

    from ray_zep.partition.node_reshard import with_node_shards
    from ray_zep.partition.plan_memory import plan_memory
    from ray_zep.partition.stats import plan_stats
    from ray_zep.step_plan import plan_step

    config, topology, shape = zeppelin_case(64, "7b", 5120)
    lengths = np.full(64, 4096)
    stats = plan_stats(plan_step(lengths, config, topology, shape).attention, shape)
    said = "node shard kept from forward to backward (parallel.reshard_to_node)"
    assert said in plan_memory(config, topology, stats, shape).table()
    apart = plan_memory(with_node_shards(config, False), topology, stats, shape)
    assert said not in apart.table()


@pytest.mark.unit
def test_unset_the_memory_model_decides_and_the_key_means_nothing_where_it_cannot_apply() -> None:
    """Unset: true where the GPU's memory holds the shards at L all in rings (7B at 4k on
    cluster A), false where it does not (13B at 16k) and on a virtual topology, whose
    GPU's memory is unknown; set, as set; false on one node and under hsdp, and with
    FSDP's collectives compressed (true there is refused, naming both keys)."""
    from ray_zep.config import load_config
    from ray_zep.errors import ConfigError
    from ray_zep.partition.node_reshard import reshards_to_node, with_node_shards
    from ray_zep.topology import build_topology

    config, topology, shape = zeppelin_case(64, "7b", 5120)
    assert reshards_to_node(config, topology, shape)
    assert not reshards_to_node(with_node_shards(config, False), topology, shape)
    config, topology, shape = zeppelin_case(64, "13b", 40960)
    assert not reshards_to_node(config, topology, shape)
    assert reshards_to_node(with_node_shards(config, True), topology, shape)
    for overrides in (["topology.nodes=2", "topology.gpus_per_node=2"],
                      ["topology.nodes=1", "topology.gpus_per_node=4"]):  # fmt: skip
        virtual = load_config(None, [*overrides, "parallel.weights=fsdp"])
        assert not reshards_to_node(virtual, build_topology(virtual.topology))
    keys = ["topology.preset=cluster_a", "topology.nodes=8", "parallel.weights=hsdp"]
    hsdp = load_config(None, [*keys, "parallel.reshard_to_node=true"])
    assert not reshards_to_node(hsdp, build_topology(hsdp.topology))
    zipped = with_node_shards(load_config(None, [*keys[:2], "parallel.weights=fsdp",
                                                 "comm.compression=auto"]), None)  # fmt: skip
    assert not reshards_to_node(zipped, build_topology(zipped.topology))
    with pytest.raises(ConfigError, match=r"reshard_to_node=true with comm\.compression"):
        reshards_to_node(with_node_shards(zipped, True), build_topology(zipped.topology))


@pytest.mark.unit
def test_the_simulator_gathers_in_the_node_and_the_bound_counts_that_gather() -> None:
    """Cluster A, 7B over 256 GPUs: the backward's block collectives take less with the
    gather on the node (its 1/8 shards over the node's links against 1/256 over every
    rank's ring), so does the bound of the run that gathers there, and neither step
    beats its own bound."""
    import numpy as np

    from ray_zep.partition.node_reshard import with_node_shards
    from ray_zep.sim.bound import step_bound
    from ray_zep.sim.hardware import Hardware
    from ray_zep.sim.step import RunModel, simulate_plan, weights_of
    from ray_zep.step_plan import plan_step

    config, topology, shape = zeppelin_case(256, "7b", 5120)
    hardware = Hardware.preset(topology)
    runs = [RunModel.create(with_node_shards(config, on), hardware) for on in (False, True)]
    apart, kept = (weights_of(run) for run in runs)
    assert not apart.regather_in_node and kept.regather_in_node
    assert kept.layer_sync[0] == apart.layer_sync[0]
    assert kept.layer_sync[1] < apart.layer_sync[1]
    rng = np.random.default_rng(0)
    lengths = rng.integers(256, 12000, size=256 * 4096 // 6000)
    bounds = [step_bound(lengths, run).seconds for run in runs]
    assert bounds[1] <= bounds[0]
    step = plan_step(lengths, config, topology, shape)
    routed = config.parallel.routing
    seconds = [simulate_plan(step.attention, run, routed, step.remap).step_seconds for run in runs]
    assert seconds[1] < seconds[0]
    assert seconds[0] >= bounds[0] and seconds[1] >= bounds[1]
    assert dataclasses.replace(runs[1].config.parallel, reshard_to_node=None) == config.parallel


@pytest.mark.unit
def test_bench_scale_keeps_the_node_shards_where_they_fit_and_says_so() -> None:
    """`bench scale`, 7B github on 64 GPUs at 4k: the row keeps the node's shards (room for
    them without recomputing) and steps no slower than with the key false, each over its
    own bound; set false, the row says so and keeps the gather over every rank."""
    from ray_zep.bench.scale import ScaleBenchSpec, run_scale_bench

    grid = {"gpus": (64,), "distributions": ("github",), "models": ("7b",),
            "tokens_per_gpu": (4096,), "placements": ("zeppelin",)}  # fmt: skip
    off = ("parallel.reshard_to_node=false",)
    (kept,) = run_scale_bench(ScaleBenchSpec(**grid), progress=lambda line: None)
    (apart,) = run_scale_bench(ScaleBenchSpec(**grid, overrides=off), progress=lambda line: None)
    assert kept.node_shards is True and apart.node_shards is False
    assert kept.checkpointing == apart.checkpointing == "none"
    assert kept.step_s < apart.step_s
    assert kept.step_over_bound >= 1.0 and apart.step_over_bound >= 1.0
    assert kept.peak_memory_gb > apart.peak_memory_gb


@pytest.mark.unit
def test_a_step_counts_the_backward_gather_on_the_node_links() -> None:
    """The trainer's traffic: the blocks gathered again inside each node add bytes on the
    nodes' own links only; gathered again over every rank they cross the NICs too."""
    from ray_zep.config import load_config
    from ray_zep.topology import build_topology
    from ray_zep.traffic import sharded_weights_traffic

    config = load_config(None, ["topology.nodes=4", "topology.gpus_per_node=4"])
    topology = build_topology(config.topology)
    blocks = 16_000
    once = sharded_weights_traffic(blocks, blocks, topology, group=0)
    twice = sharded_weights_traffic(2 * blocks, blocks, topology, group=0)
    on_node = sharded_weights_traffic(blocks, blocks, topology, group=0, node_gathered=blocks)
    assert on_node.inter_node == once.inter_node < twice.inter_node
    # each node's ring of 4 moves 3/4 of the blocks over each of its 4 links
    assert on_node.intra_node - once.intra_node == 4 * 4 * 3 * blocks // 4
