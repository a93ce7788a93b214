"""fsdp over shard groups of whole nodes (`parallel.shard_nodes`): the config's rules,
what the memory model, the simulator and the traffic count charge for them, and the
trainer's (replicate, shard) mesh training like one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_zep.config import load_config
from ray_zep.config.sizes import check_run
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import WeightsMode
from ray_zep.parallel.memory import owned_params
from ray_zep.parallel.shard_groups import replica_groups, shard_groups
from ray_zep.run_memory import memory_inputs, node_reshard_applies
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.weights import weights_cost
from ray_zep.topology import build_topology
from ray_zep.traffic import sharded_weights_traffic
from tests.helpers.procs import run_ranks
from tests.helpers.training import SMALL_RUN, max_relative_error, mixed_dataset, train_rank


def _config(nodes: int, *extra: str):
    return load_config(None, ["topology.preset=cluster_a", f"topology.nodes={nodes}",
                              "model.preset=13b", "parallel.weights=fsdp", *extra])  # fmt: skip


@pytest.mark.parametrize(
    "extra,named",
    [
        (["parallel.shard_nodes=3"], "must divide topology.nodes=8"),
        (["parallel.shard_nodes=2", "parallel.weights=hsdp"], "not hsdp"),
        (["parallel.shard_nodes=-1"], "must be >= 0"),
    ],
)
def test_shard_groups_are_refused_where_they_cannot_run(extra, named) -> None:
    with pytest.raises(ConfigError, match=r"parallel\.shard_nodes") as caught:
        check_run(_config(8, *extra))
    assert named in str(caught.value)


def test_groups_and_replicas_cover_every_rank_once() -> None:
    groups, replicas = shard_groups(4, 12), replica_groups(4, 12)
    assert groups == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))
    assert replicas == ((0, 4, 8), (1, 5, 9), (2, 6, 10), (3, 7, 11))


def test_a_rank_holds_its_groups_share_of_the_state() -> None:
    """Each rank stores 1 / (its group's ranks) of the parameters: 16 nodes' 128 GPUs of
    1,024; hsdp's group is one node, as fsdp over groups of one node."""
    shape = build_shape(_config(128).model)
    topology = build_topology(_config(128).topology)

    def owned(*extra: str) -> float:
        return owned_params(shape, memory_inputs(_config(128, *extra), topology, 1024))

    assert owned() == pytest.approx(shape.param_count() / 1024)
    assert owned("parallel.shard_nodes=16") == pytest.approx(shape.param_count() / 128)
    assert owned("parallel.shard_nodes=1") == owned("parallel.weights=hsdp")
    # the blocks kept sharded over a node after forward need a group of several nodes
    assert node_reshard_applies(_config(128, "parallel.shard_nodes=2"), topology)
    assert not node_reshard_applies(_config(128, "parallel.shard_nodes=1"), topology)


def test_the_simulator_charges_the_groups_collectives_and_the_replicas_all_reduce() -> None:
    """Over 1,024 GPUs a gather over every rank waits 4 ms on its ring steps; groups of 16
    nodes gather over 128 ranks, each reduced shard then all-reduced with its 8 replicas
    in the backward. Groups of one node cost what hsdp does."""
    config = _config(128)
    shape = build_shape(config.model)
    hardware = Hardware.preset(build_topology(config.topology))
    cost = hardware.cost(shape)
    world = weights_cost(WeightsMode.FSDP, shape, cost, 2)
    grouped = weights_cost(WeightsMode.FSDP, shape, cost, 2, shard_nodes=16)
    block = world.owned_params * 1024 / shape.param_count()  # the blocks' share: 1 here
    assert grouped.groups == shard_groups(128, 1024)
    assert grouped.owned_params == pytest.approx(shape.param_count() / 128 * block)
    latency = cost.all_gather_seconds(0.0, range(1024)) - cost.all_gather_seconds(0.0, range(128))
    assert world.layer_sync[0] - grouped.layer_sync[0] == pytest.approx(latency, rel=0.05)
    assert grouped.backward_groups == (tuple(range(1024)),)  # the replicas cross every node
    assert grouped.layer_sync[1] < world.layer_sync[1] and grouped.exposed < world.exposed
    one_node = weights_cost(WeightsMode.FSDP, shape, cost, 2, shard_nodes=1)
    assert one_node == weights_cost(WeightsMode.HSDP, shape, cost, 2)


def test_the_traffic_count_rings_each_group_then_its_replicas() -> None:
    """4 nodes x 2 GPUs in groups of 2 nodes: each group's ring crosses between its two
    nodes twice; each replica ring (2 ranks, 2 nodes apart) crosses twice with its shard."""
    config = load_config(None, ["topology.nodes=4", "topology.gpus_per_node=2"])
    topology = build_topology(config.topology)
    gathered, grads = 4000, 4000
    grouped = sharded_weights_traffic(gathered, grads, topology, group=4)
    group_rings = 2 * 2 * (3 * (gathered + grads) // 4)
    replica_rings = 4 * 2 * (grads // 4)
    assert grouped.inter_node == group_rings + replica_rings
    whole = sharded_weights_traffic(gathered, grads, topology)
    assert whole.inter_node == 4 * (7 * (gathered + grads) // 8)


def _train_all(rank: int, world: int, runs: dict[str, list[str]]) -> dict:
    return {name: train_rank(rank, world, overrides) for name, overrides in runs.items()}


@pytest.mark.dist
def test_shard_groups_of_two_nodes_train_like_one_process(tmp_path: Path) -> None:
    """4 nodes x 2 GPUs, fsdp over 2 groups of 2 nodes (each rank's shard all-reduced with
    its replica): whole sequences, and zeppelin's plans with the blocks kept sharded over
    the node after forward (`parallel.reshard_to_node`, inside the group); 2 steps each
    against one process on the same batches (fp32, rel <= 1e-5)."""
    data = mixed_dataset(tmp_path / "mixed.parquet")
    base = [*SMALL_RUN, "topology.nodes=4", "topology.gpus_per_node=2",
            "train.tokens_per_rank=64", "train.steps=2", "train.save_last=false",
            f"data.source={data}", "data.shuffle=false"]  # fmt: skip
    grouped = ["parallel.weights=fsdp", "parallel.shard_nodes=2"]
    runs = {
        "whole": [*base, "data.packing=rank", *grouped],
        "zeppelin": [
            *base,
            "data.packing=budget",
            "parallel.sequence=zeppelin",
            *grouped,
            "parallel.reshard_to_node=true",
        ],
    }
    singles = {
        "whole": [*base, "data.packing=rank", "parallel.sequence=single"],
        "zeppelin": [*base, "data.packing=budget", "parallel.sequence=single"],
    }

    def out(runs: dict, tag: str) -> dict:
        return {n: [*o, f"train.out_dir={tmp_path / tag / n}"] for n, o in runs.items()}

    single = run_ranks(_train_all, 1, out(singles, "single"))[0]
    trained = run_ranks(_train_all, 8, out(runs, "grouped"))[0]
    for name, run in trained.items():
        assert run["samples"] == single[name]["samples"], name
        for step, loss in single[name]["losses"].items():
            assert run["losses"][step] == pytest.approx(loss, rel=1e-5), (name, step)
        err, param = max_relative_error(run["params"], single[name]["params"])
        assert err <= 1e-5, f"{name}: parameter {param} relative error {err:.2e}"


def test_plan_auto_plays_the_fastest_fsdp_composition_over_its_shard_groups() -> None:
    """The shard-group phase takes the fastest fitting candidate; fsdp over one group of
    128 nodes is played again over groups of 16 (the cost model's fastest), under the
    config's activation checkpointing; on 8 nodes one group is fastest, and a composition
    of another weights mode or with its groups set is left alone."""
    from types import SimpleNamespace

    from ray_zep.sim.auto_ranking import AutoPlan, Candidate
    from ray_zep.sim.auto_shards import shard_group_twin

    def twin(nodes: int, *extra: str):
        config = _config(nodes, *extra)
        hardware = Hardware.preset(build_topology(config.topology))
        hsdp = _config(nodes, "parallel.weights=hsdp")
        slow = Candidate(hsdp, [SimpleNamespace(step_seconds=2.0)])
        fast = Candidate(config, [SimpleNamespace(step_seconds=1.0)])
        return shard_group_twin(AutoPlan([slow, fast]), _config(nodes), hardware), fast

    found, fast = twin(128, "train.activation_checkpointing=selective")
    grouped, of = found
    assert of is fast and grouped.parallel.shard_nodes == 16
    assert grouped.train.activation_checkpointing.value == "none"  # the config's own
    assert twin(8)[0] is None
    assert twin(128, "parallel.shard_nodes=32")[0] is None
    assert twin(128, "parallel.weights=hsdp")[0] is None
