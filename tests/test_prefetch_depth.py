"""Blocks gathered two ahead (`parallel.prefetch_depth`): the simulator runs the gather's
ring-step latency before the block that waits for it where it fits there
(`ray_zep.sim.prefetched`), the memory model holds one more block, and the key is
checked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ray_zep.config import load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.memory import model_memory
from ray_zep.run_memory import memory_inputs
from ray_zep.sim.bound import step_bound
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.prefetched import WEIGHT_LATENCY, latency_window
from ray_zep.sim.step import RunModel, plan_batch, simulate_plan, weights_of
from ray_zep.topology import build_topology

pytestmark = pytest.mark.unit


def _run(depth: int, latency_us: float) -> RunModel:
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=8",
                                "model.preset=7b", "train.tokens_per_rank=5120",
                                "parallel.weights=fsdp", "parallel.sequence=zeppelin",
                                "parallel.routing=true", f"parallel.prefetch_depth={depth}",
                                f"topology.intra_node_latency_us={latency_us}",
                                f"topology.inter_node_latency_us={latency_us}"])  # fmt: skip
    return RunModel.create(config, Hardware.preset(build_topology(config.topology)))


def _latency_tasks(timeline) -> list[float]:
    return [t.duration for t in timeline.graph.tasks if t.name == WEIGHT_LATENCY]


@pytest.mark.parametrize("latency_us", [60.0, 400.0])
def test_two_ahead_runs_the_gather_latency_before_the_block_where_it_fits(latency_us) -> None:
    """64 GPUs, 7B under FSDP over every rank, links of `latency_us` per ring step (a
    gather's 63 steps: 3.8 ms; 25 ms, longer than a forward layer). One block ahead, each
    forward layer waits for the whole latency before the gather's bytes. Two ahead, where
    it fits between the bytes and the next block's post, for none of it (the backward
    still for its reduce-scatter's), and the step is shorter; where it does not, the
    gathers outlast the compute and the step is the same as one ahead. The bound counts
    every gather whole and stays under both."""
    lengths = batch_lengths("arxiv", 4096 * 64, 0)
    runs = {depth: _run(depth, latency_us) for depth in (1, 2)}
    plan, remap = plan_batch(lengths, runs[1])
    steps = {d: simulate_plan(plan, run, True, remap) for d, run in runs.items()}
    latency = weights_of(runs[2]).layer_latency[0]
    assert weights_of(runs[2]).hidden_latency == (latency, latency) and latency > 0
    assert weights_of(runs[1]).hidden_latency == (0.0, 0.0)
    assert _latency_tasks(steps[1].forward) == [pytest.approx(latency)]
    fits = latency <= latency_window(steps[2].forward)
    assert fits == (latency_us < 100)
    if fits:
        assert _latency_tasks(steps[2].forward) == []
        assert _latency_tasks(steps[2].backward) == [pytest.approx(latency)]
        assert _latency_tasks(steps[1].backward) == [pytest.approx(2 * latency)]
        assert steps[2].step_seconds < 0.97 * steps[1].step_seconds
    else:
        assert _latency_tasks(steps[2].forward) == [pytest.approx(latency)]
        assert steps[2].step_seconds == steps[1].step_seconds
    bound = step_bound(lengths, runs[2]).seconds
    assert step_bound(lengths, runs[1]).seconds == bound <= steps[2].step_seconds


def test_two_ahead_holds_one_more_block() -> None:
    """7B under FSDP, blocks as units: two ahead holds three blocks gathered at the
    backward's peak, one ahead two (in bf16), and without prefetch one."""
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=2",
                                "model.preset=7b", "parallel.weights=fsdp"])  # fmt: skip
    shape, topology = build_shape(config.model), build_topology(config.topology)

    def params(**parallel) -> float:
        changed = dataclasses.replace(config.parallel, **parallel)
        inputs = memory_inputs(dataclasses.replace(config, parallel=changed), topology, 4096,
                               dtype=torch.bfloat16, on_cpu=False)  # fmt: skip
        return model_memory(shape, inputs).params

    block = shape.param_count() - 2 * shape.vocab_size * shape.dim
    block = (block - shape.dim) / shape.n_layers * 2  # bf16 bytes of one block
    one, two = params(prefetch_depth=1), params(prefetch_depth=2)
    assert two - one == pytest.approx(block, rel=1e-6)
    assert one - params(prefetch=False) == pytest.approx(block, rel=1e-6)


def test_unset_two_ahead_where_a_gather_over_the_group_waits_two_ms() -> None:
    """Unset (`ray_zep.prefetch_plan.prefetch_depth`): cluster A under FSDP over every
    rank, one ahead at 64 and 256 GPUs (a gather's ring steps: 0.24 and 0.98 ms), two at
    1,024 and 4,096 (4.0 and 15.9 ms); one under hsdp (a node's 8 GPUs) and where blocks
    are not units; a set value is kept."""
    from ray_zep.prefetch_plan import prefetch_depth

    def depth(gpus: int, *overrides: str) -> int:
        config = load_config(None, ["topology.preset=cluster_a", f"topology.nodes={gpus // 8}",
                                    "parallel.weights=fsdp", *overrides])  # fmt: skip
        return prefetch_depth(config.parallel, build_topology(config.topology))

    assert [depth(g) for g in (64, 256, 1024, 4096)] == [1, 1, 2, 2]
    assert depth(4096, "parallel.weights=hsdp") == 1
    assert depth(4096, "parallel.fsdp_unit=linear") == 1
    assert depth(64, "parallel.prefetch_depth=3") == 3


def test_a_depth_outside_its_range_is_refused_by_name() -> None:
    for depth in (0, 5):
        with pytest.raises(ConfigError, match=r"parallel\.prefetch_depth"):
            load_config(None, [f"parallel.prefetch_depth={depth}"])
