"""Where a simulated step's GPU-time goes (`ray_zep.sim.gpu_time`)."""

from __future__ import annotations

import dataclasses

import pytest

from ray_zep.config import load_config
from ray_zep.parallel.axes import Placement
from ray_zep.partition.plan import AttentionPlan, SeqPlacement, bounds_for_counts
from ray_zep.sim.events import Lane
from ray_zep.sim.gpu_time import SHARES, gpu_time_shares
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.request import SimulateRequest, run_simulate
from ray_zep.sim.step import RunModel, simulate_plan
from ray_zep.topology import build_topology

pytestmark = pytest.mark.unit

L = 5120


def _half_node_group_step():
    """A 32,652-token document on three half-node USP positions (ranks 4-15) of cluster
    A's 4 nodes, routed: its K/V take longer to cross nodes than its ring steps compute,
    and 20 of the 32 ranks hold nothing."""
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=4",
                                "model.preset=7b", f"train.tokens_per_rank={L}",
                                "parallel.weights=fsdp", "parallel.sequence=zeppelin",
                                "parallel.routing=true"])  # fmt: skip
    topology = build_topology(config.topology)
    run = RunModel.create(config, Hardware.preset(topology))
    n = 32652
    counts = [n // 3] * 2 + [n - n // 3 * 2]
    group = SeqPlacement(0, n, tuple(range(4, 16)), bounds_for_counts(counts), ulysses=4)
    plan = AttentionPlan(Placement.ZEPPELIN, topology, L, (group,))
    return simulate_plan(plan, run, True, None), topology.world_size


def test_the_shares_add_up_and_count_every_rank() -> None:
    step, world = _half_node_group_step()
    shares = gpu_time_shares(step, world)
    assert set(shares) == set(SHARES)
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-9)
    assert min(shares.values()) >= -1e-12
    span = step.forward.makespan + step.backward.makespan
    # computing, counted the timelines' own way (`Timeline.busy`)
    busy = sum(t.busy(r, Lane.COMPUTE) for t in (step.forward, step.backward) for r in range(world))
    assert shares["computing"] == pytest.approx(busy / (world * span), rel=1e-9)
    # the 20 ranks that hold nothing wait for the whole of both layers
    assert shares["waiting for the slowest"] >= 20 / world
    # the group's forward hops outlast its steps: its members idle between them
    assert shares["idle in its ring"] > 0


def test_steps_without_whole_step_timelines_have_none() -> None:
    step, world = _half_node_group_step()
    assert gpu_time_shares(dataclasses.replace(step, forward=None), world) is None
    longer = dataclasses.replace(step, forward_layer_seconds=2 * step.forward_layer_seconds)
    assert gpu_time_shares(longer, world) is None  # several plans' layers summed


def test_simulate_records_the_shares_of_each_strategy() -> None:
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=2",
                                "model.preset=7b", f"train.tokens_per_rank={L}"])  # fmt: skip
    request = SimulateRequest("zeppelin,te_cp", batches=1, distribution="chat", tokens=16 * L)
    result = run_simulate(config, request)
    record = result.record()["strategies"]
    for name in ("zeppelin", "te_cp"):
        shares = record[name]["gpu_time_shares"]
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-9), name
        assert 0 < shares["computing"] < 1, name
    # te_cp rotates every sequence's K/V over all 16 GPUs, through the NICs: its ranks idle
    # in its rings longer than they compute (0.63 and 0.28), zeppelin's compute 0.88
    te_cp, zeppelin = (record[name]["gpu_time_shares"] for name in ("te_cp", "zeppelin"))
    assert te_cp["idle in its ring"] > te_cp["computing"]
    assert zeppelin["computing"] > 2 * te_cp["computing"]


def test_a_step_of_micro_batches_counts_all_of_theirs() -> None:
    step, world = _half_node_group_step()
    one = gpu_time_shares(step, world)
    twice = gpu_time_shares(dataclasses.replace(step, micro_steps=(step, step)), world)
    assert twice == pytest.approx(one, rel=1e-12)
    blind = dataclasses.replace(step, forward=None)
    assert gpu_time_shares(dataclasses.replace(step, micro_steps=(step, blind)), world) is None
