"""The weight-passing step model and `ray-zep bench tawpipe`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ray_zep.bench.tawpipe import (
    FSDP,
    RELAY,
    TAW,
    WEI,
    TawPipeBenchSpec,
    case_rows,
    llama_shape,
    paper_bubble,
    ratio,
)
from ray_zep.cli import main
from ray_zep.config import load_config
from ray_zep.parallel.axes import Passing, WeightsMode
from ray_zep.parallel.pipeline_layout import WeightLayout
from ray_zep.pipeline.messages import step_traffic
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.weight_passing import (
    WEIGHT_BYTES,
    Workload,
    sequences_that_fit,
    shard_compute,
    simulate_step,
    tawpipe_testbed,
    unit_sizes,
)
from ray_zep.sim.weipipe_schedule import (
    chunk_times,
    fastest_weipipe,
    micro_batch_that_fits,
    simulate_weipipe,
    slot_links,
    slot_shards,
    weipipe_bubble,
)
from ray_zep.topology import build_topology

pytestmark = pytest.mark.unit
STRATEGIES = (WeightsMode.TAWPIPE, WeightsMode.RING_RELAY, WeightsMode.FSDP)
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
    assert steps[WeightsMode.RING_RELAY].seconds > 2 * steps[WeightsMode.TAWPIPE].seconds
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
    assert paper_bubble(WEI, 24, 3, 8) == pytest.approx(23 / 31)
    assert paper_bubble(WEI, 24, 3, 2 * 24) == pytest.approx(weipipe_bubble(24, 2))
    assert paper_bubble(TAW, 24, 3, 8) == pytest.approx(56 / 632)
    assert paper_bubble(FSDP, 24, 3, 8) is None and paper_bubble(RELAY, 24, 3, 8) is None


def test_bench_tawpipe_writes_table_json_and_chart(tmp_path: Path, capsys) -> None:
    args = ["bench", "tawpipe", "--hidden", "1024", "--seq-lens", "4k", "--cpu-steps", "0"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tawpipe/weipipe" in out and "tawpipe/ring_relay" in out
    assert "13629" in next(line for line in out.splitlines() if "| tawpipe " in line)
    record = json.loads((tmp_path / "tawpipe.json").read_text())
    assert [r["mode"] for r in record["rows"]] == [TAW, WEI, RELAY, FSDP]
    assert (tmp_path / "tawpipe.png").stat().st_size > 1000
    assert "goals" not in record  # the headline case was not asked for
    headline = ["bench", "tawpipe", "--hidden", "4096", "--seq-lens", "16k", "--cpu-steps", "0"]
    assert main([*headline, "--out", str(tmp_path / "headline")]) == 0
    goals = json.loads((tmp_path / "headline" / "tawpipe.json").read_text())["goals"]
    assert [g["goal"].split(":")[0] for g in goals] == [
        "tawpipe / weipipe at H=4096 S=16384 on 24 GPUs"
    ]
    for bad, flag in (("--nic-gbps", "0"), ("--hidden", "1000"), ("--cpu-steps", "1")):
        assert main([*args, bad, flag, "--out", str(tmp_path)]) == 2
        assert bad in capsys.readouterr().err


def test_bench_tawpipe_trains_the_executors_modes_on_cpu(tmp_path: Path, monkeypatch, capsys):
    """The CPU runs (stubbed here: they train through Ray) go under the simulated table
    and into the record's `cpu`, apart from the simulated `rows`."""
    import ray_zep_workers.bench_train as train_bench

    trained = []

    def fake_runs(config, overrides, modes, steps, out):
        trained.append((config, modes, steps, out.name))
        rows = [train_bench.TrainBenchRow(mode, 1e3, 1.1e3, 1.0, 0.9, 4.0) for mode in modes]
        return rows, None

    monkeypatch.setattr(train_bench, "run_train_bench", fake_runs)
    args = ["bench", "tawpipe", "--hidden", "1024", "--seq-lens", "4k", "--cpu-steps", "3"]
    assert main([*args, "--out", str(tmp_path)]) == 0
    assert trained == [("conf/demo.yaml", (TAW, RELAY, FSDP), 3, "cpu")]
    out = capsys.readouterr().out
    assert "real CPU runs (conf/demo.yaml, 3 steps each):" in out
    assert out.index("| 1024 |") < out.index("real CPU runs") < out.index("| strategy ")
    record = json.loads((tmp_path / "tawpipe.json").read_text())
    assert [r["name"] for r in record["cpu"]] == [TAW, RELAY, FSDP]
    assert record["cpu"][0]["predicted_over_measured"] == pytest.approx(1.1)
    assert [r["mode"] for r in record["rows"]] == [TAW, WEI, RELAY, FSDP]


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


@pytest.mark.parametrize("micro_batches", [2, 3, 8])
def test_weipipe_on_free_links_idles_only_to_fill_and_drain_its_ring(micro_batches: int) -> None:
    step = simulate_weipipe(WORK, FAST, micro_batches)
    assert step.bubble == pytest.approx(23 / (24 * micro_batches + 23), rel=1e-9)
    assert weipipe_bubble(24, micro_batches) == pytest.approx(23 / (24 * micro_batches + 23))
    # per micro-batch: each 2-block chunk forward, recomputed and backward, the head once
    micro = Workload(SHAPE, WORK.lengths, share=1 / micro_batches)
    forward, backward = shard_compute(micro, FAST.rates, range(1, 3))
    head = sum(shard_compute(micro, FAST.rates, range(49, 50)))
    want = micro_batches * (24 * (2 * forward + backward) + head)
    assert step.compute_seconds == pytest.approx(want, rel=1e-9)
    assert step.tokens == 8 * 4096


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_weipipe_never_speeds_up_when_a_link_slows(micro_batches: int) -> None:
    for knob in ("nic_gbits_per_s", "intra_gbytes_per_s"):
        seconds = [
            simulate_weipipe(
                WORK, TAWPIPE_TESTBED.with_links(**{knob: rate}), micro_batches
            ).seconds
            for rate in (1000.0, 100.0, 10.0, 1.0, 0.1)
        ]
        assert seconds == sorted(seconds), knob
        assert seconds[-1] > 1.5 * seconds[0], f"{knob}: the slowest link must show"


def test_weipipe_slot_sends_three_shards_per_ring_link_and_shares_the_nic() -> None:
    shard = 1e8
    cluster = TAWPIPE_TESTBED
    links = slot_links(cluster, shard, 2, 1)
    # each node has one ring link leaving it each way: two shards ahead, one back
    assert links.seconds == pytest.approx(
        3 * shard / cluster.node_nic_bandwidth + cluster.inter_latency
    )
    assert links.inter_bytes == pytest.approx(3 * 3 * shard)
    assert links.intra_bytes == pytest.approx(24 * 3 * shard - 9 * shard)
    one_node = Hardware.preset(
        build_topology(load_config(None, ["topology.nodes=1", "topology.gpus_per_node=8"]).topology)
    )
    inside = slot_links(one_node, shard, 2, 1)
    assert inside.inter_bytes == 0.0
    assert inside.seconds == pytest.approx(
        3 * shard / one_node.intra_bandwidth + one_node.intra_latency
    )
    ahead, back = slot_shards(24, 4)
    assert len(ahead) == 4 * 24 + 2 * 24 - 1
    # forward weights for every forward but the last, gradients and backward weights
    # for every backward but the last (which start at slot P)
    assert ahead.sum() == 2 * (4 * 24 + 22) and back.sum() == 4 * 24 + 22
    assert (ahead[:24] == 1).all() and (back[:24] == 0).all() and ahead[-1] == back[-1] == 0


def test_a_link_bound_weipipe_pays_p_slots_of_three_shards_per_micro_batch() -> None:
    slow = TAWPIPE_TESTBED.with_links(nic_gbits_per_s=0.1)
    shard = WEIGHT_BYTES * unit_sizes(SHAPE)[1] * 2
    slot = 3 * shard / slow.node_nic_bandwidth + slow.inter_latency
    more = simulate_weipipe(WORK, slow, 4).seconds - simulate_weipipe(WORK, slow, 2).seconds
    # the last slot sends nothing: its backward alone, of a smaller micro-batch
    last = chunk_times(WORK, slow, 4).backward - chunk_times(WORK, slow, 2).backward
    assert more == pytest.approx(2 * 24 * slot + last, rel=1e-9)


def test_weipipe_micro_batches_fit_its_memory_and_run_fastest() -> None:
    short = micro_batch_that_fits(SHAPE, 4096, TAWPIPE_TESTBED)
    long = micro_batch_that_fits(SHAPE, 16384, TAWPIPE_TESTBED)
    assert 1 <= long < short <= 64
    tiny = dataclasses.replace(
        TAWPIPE_TESTBED,
        topology=dataclasses.replace(TAWPIPE_TESTBED.topology, gpu_memory_bytes=1e9 / 0.9),
    )
    assert micro_batch_that_fits(llama_shape(4096), 16384, tiny) == 0
    found = fastest_weipipe(WORK, TAWPIPE_TESTBED, most=2)
    assert found is not None
    batches, step = found
    assert batches in (4, 8)
    assert step.seconds == min(simulate_weipipe(WORK, TAWPIPE_TESTBED, g).seconds for g in (4, 8))
    assert fastest_weipipe(WORK, TAWPIPE_TESTBED, most=0) is None
    assert (
        chunk_times(WORK, TAWPIPE_TESTBED, 2).backward
        > 2 * chunk_times(WORK, TAWPIPE_TESTBED, 2).forward
    ), "backward recomputes the chunk"


def test_the_weipipe_model_stands_between_tawpipe_and_the_ring_relay() -> None:
    rows = case_rows(TawPipeBenchSpec(), 1024, 4096)
    assert [r.mode for r in rows] == [TAW, WEI, RELAY, FSDP]
    wei = rows[1]
    assert wei.sequences == 64 and 64 % wei.micro_batch == 0
    assert wei.micro_batch <= micro_batch_that_fits(SHAPE, 4096, TawPipeBenchSpec().cluster())
    over_weipipe, over_relay = ratio(rows, 1024, 4096), ratio(rows, 1024, 4096, RELAY)
    assert 1.0 < over_weipipe < over_relay


def test_shards_and_sums_travel_zipped_where_compression_is_on() -> None:
    """With comm.compression the executor chains every transfer through messages; on two
    nodes a chain is the broadcast's one hop, and zipped bf16 shards (1.425x) and sums
    (1.378x) shorten a link-bound step; streams left out travel plain."""
    from ray_zep.config import CommConfig, Compression
    from ray_zep.sim.weight_passing import ShardWire
    from ray_zep.sim.wire import WireCodec

    config = load_config(None, ["topology.preset=tawpipe_a100", "topology.nodes=2"])
    two = Hardware.preset(build_topology(config.topology))
    rate = 1e12  # a codec far faster than 10 GbE

    def step(mode: WeightsMode, compression: Compression, streams=None) -> float:
        comm = CommConfig(compression=compression)
        if streams is not None:
            comm = dataclasses.replace(comm, compression_streams=streams)
        return simulate_step(mode, WORK, two, ShardWire(WireCodec.create(comm, rate))).seconds

    for mode in (WeightsMode.TAWPIPE, WeightsMode.RING_RELAY):
        off = step(mode, Compression.OFF)
        assert off == simulate_step(mode, WORK, two).seconds
        zipped = step(mode, Compression.ALWAYS)
        assert zipped < 0.9 * off, mode
        assert step(mode, Compression.AUTO) <= off
        shards_only = step(mode, Compression.ALWAYS, ["weight_shards"])
        assert zipped < shards_only < off, mode
    # FSDP's comparison collectives stay plain
    fsdp = WeightsMode.FSDP
    assert step(fsdp, Compression.ALWAYS) == step(fsdp, Compression.OFF)
