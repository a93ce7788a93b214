"""The weight-passing step model and `ray-zep bench tawpipe`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ray_zep.bench.tawpipe import llama_shape, paper_bubble
from ray_zep.cli import main
from ray_zep.config import load_config
from ray_zep.parallel.axes import Passing, WeightsMode
from ray_zep.pipeline.layout import WeightLayout
from ray_zep.pipeline.messages import step_traffic
from ray_zep.sim.weight_passing import (
    WEIGHT_BYTES,
    Workload,
    sequences_that_fit,
    shard_compute,
    simulate_step,
    tawpipe_testbed,
    unit_sizes,
)
from ray_zep.topology import build_topology

pytestmark = pytest.mark.unit
STRATEGIES = (WeightsMode.TAWPIPE, WeightsMode.WEIPIPE, WeightsMode.FSDP)
SHAPE = llama_shape(1024, layers=48)
WORK = Workload(SHAPE, (4096,) * 8)
TAWPIPE_TESTBED = tawpipe_testbed()
FAST = dataclasses.replace(
    TAWPIPE_TESTBED,
    topology=dataclasses.replace(
        TAWPIPE_TESTBED.topology,
        nic_bandwidth=1e30,
        intra_node_bandwidth=1e30,
        inter_node_latency=0.0,
        intra_node_latency=0.0,
    ),
)


def _compute_seconds(work: Workload) -> float:
    """Forward, backward and recompute of every shard (the last is not recomputed)."""
    sizes = unit_sizes(work.shape)
    layout = WeightLayout.build(WeightsMode.TAWPIPE, sizes, 3, 8)
    total = 0.0
    for shard, units in enumerate(layout.units):
        forward, backward = shard_compute(work, TAWPIPE_TESTBED.rates, units)
        total += 2 * forward + backward if shard < layout.shards - 1 else forward + backward
    return total


def test_free_links_leave_no_bubble_and_every_strategy_computes_alike() -> None:
    compute = _compute_seconds(WORK)
    for strategy in STRATEGIES:
        step = simulate_step(strategy, WORK, FAST)
        assert step.bubble == pytest.approx(0.0, abs=1e-9), strategy
        assert step.seconds == pytest.approx(compute, rel=1e-9)
        assert step.tokens_per_gpu_s == pytest.approx(8 * 4096 / compute)


def test_tawpipe_moves_each_shard_across_nodes_once_per_transfer() -> None:
    sizes = unit_sizes(SHAPE)
    layout = WeightLayout.build(WeightsMode.TAWPIPE, sizes, 3, 8)
    shard_bytes = [WEIGHT_BYTES * sum(sizes[u] for u in units) for units in layout.units]
    # every shard fetched for forward and again for backward (the last stays), summed once
    moved = 3 * sum(shard_bytes) - shard_bytes[-1]
    step = simulate_step(WeightsMode.TAWPIPE, WORK, TAWPIPE_TESTBED)
    assert step.inter_bytes == pytest.approx((3 - 1) * moved)
    assert step.intra_bytes == pytest.approx(3 * (8 - 1) * moved)
    assert sum(sizes) == SHAPE.param_count()


def test_slow_links_show_as_bubble_and_the_lockstep_ring_waits_longest() -> None:
    steps = {s: simulate_step(s, WORK, TAWPIPE_TESTBED) for s in STRATEGIES}
    assert steps[WeightsMode.TAWPIPE].bubble > 0.05
    assert steps[WeightsMode.WEIPIPE].seconds > 2 * steps[WeightsMode.TAWPIPE].seconds
    # the same NIC bytes per transfer as the rail broadcast, so about the same time
    fsdp, tawpipe = steps[WeightsMode.FSDP].seconds, steps[WeightsMode.TAWPIPE].seconds
    assert fsdp == pytest.approx(tawpipe, rel=0.05)
    more = simulate_step(WeightsMode.TAWPIPE, Workload(SHAPE, (4096,) * 32), TAWPIPE_TESTBED)
    assert more.bubble < steps[WeightsMode.TAWPIPE].bubble, "more tokens hide more transfer"


def test_memory_decides_the_sequences_per_step() -> None:
    short = sequences_that_fit(SHAPE, 4096, TAWPIPE_TESTBED)
    long = sequences_that_fit(SHAPE, 16384, TAWPIPE_TESTBED)
    assert 1 <= long < short <= 64
    kept = sequences_that_fit(SHAPE, 4096, TAWPIPE_TESTBED, recompute=False)
    assert kept < short, "without recompute every block's activations stay"
    tiny = dataclasses.replace(
        TAWPIPE_TESTBED,
        topology=dataclasses.replace(TAWPIPE_TESTBED.topology, gpu_memory_bytes=1e9 / 0.9),
    )
    assert sequences_that_fit(llama_shape(4096), 16384, tiny) == 0


def test_paper_bubble_formulas() -> None:
    assert paper_bubble(WeightsMode.WEIPIPE, 24, 3, 8) == pytest.approx(23 / 31)
    assert paper_bubble(WeightsMode.TAWPIPE, 24, 3, 8) == pytest.approx(56 / 632)
    assert paper_bubble(WeightsMode.FSDP, 24, 3, 8) is None


def test_bench_tawpipe_writes_table_json_and_chart(tmp_path: Path, capsys) -> None:
    args = ["bench", "tawpipe", "--hidden", "1024", "--seq-lens", "4k", "--cpu-steps", "0"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tawpipe/weipipe" in out and "13629" in out
    record = json.loads((tmp_path / "tawpipe.json").read_text())
    assert {r["mode"] for r in record["rows"]} == {"tawpipe", "weipipe", "fsdp"}
    assert (tmp_path / "tawpipe.png").stat().st_size > 1000
    for bad, flag in (("--nic-gbps", "0"), ("--hidden", "1000"), ("--cpu-steps", "1")):
        assert main([*args, bad, flag, "--out", str(tmp_path)]) == 2
        assert bad in capsys.readouterr().err


def test_step_traffic_counts_every_message_of_the_transports() -> None:
    config = load_config(None, ["topology.nodes=2", "topology.gpus_per_node=2"])
    topology = build_topology(config.topology)
    expected = {  # one step's (inter-node, intra-node) bytes for shards of 10, 20, 30, 40
        Passing.GROUPED: (3 * 60 + 2 * 40, 2 * (3 * 60 + 2 * 40)),
        None: None,
        Passing.RING: None,
    }
    for strategy, want in expected.items():
        layout = WeightLayout.build(strategy, [1, 1, 1, 1], 2, 2)
        traffic = step_traffic(layout, [10, 20, 30, 40], topology)
        moved = 3 * 100 - 40  # every shard fetched twice but the last, each summed once
        assert traffic.inter_node + traffic.intra_node == 3 * moved, strategy
        if want is not None:
            assert (traffic.inter_node, traffic.intra_node) == want
