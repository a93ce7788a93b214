"""The simulator: hand-computed cases, monotonicity, overlap bounds, Fig. 12 per-round transfer."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_zep.attention.schedule import item_layouts, position_layout, step_segments
from ray_zep.config import Config, TopologyConfig, load_config
from ray_zep.costmodel import ComputeRates, CostModel, linear_flops_per_token
from ray_zep.data.synthetic import batch_lengths
from ray_zep.model_shapes import PRESETS, ModelShape
from ray_zep.parallel.axes import Placement
from ray_zep.partition import make_plan
from ray_zep.partition.exchange import Exchange
from ray_zep.remap.solver import solve_remap
from ray_zep.routing.routes import Phase, RoutingPlan, Transfer, plan_route
from ray_zep.sim.events import CorePool, Lane, TaskGraph, simulate
from ray_zep.sim.graph_builder import LayerSetup
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.ideal import ideal_step_seconds
from ray_zep.sim.program import _Builder, layer_graph
from ray_zep.sim.step import RunModel, simulate_batch, simulate_plan, weights_of
from ray_zep.topology import LinkKind, build_topology
from tests.helpers.attention import with_exchange

SHAPE = ModelShape(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=128)
RATES = ComputeRates(1e9, 0.8e9, 2e9, call_overhead_s=1e-6, source="test")
ROW_BYTES = 2 * SHAPE.n_kv_heads * SHAPE.head_dim * 2  # K and V of one token, bf16


def _topology(nodes: int, gpus: int, nic_gbits: float = 1.0, intra_gbytes: float = 1.0):
    return build_topology(
        TopologyConfig(
            preset="virtual",
            nodes=nodes,
            gpus_per_node=gpus,
            nic_gbits_per_s=nic_gbits,
            intra_node_gbytes_per_s=intra_gbytes,
        )
    )


def _setup(plan, rates=RATES, routed=False, remap=None) -> LayerSetup:
    cost = CostModel(SHAPE, plan.topology, rates.attention_forward)
    routing = RoutingPlan.build(plan, routed=routed, all_hops=True)
    return LayerSetup(plan, SHAPE, cost, rates, routing, remap)


def _attention_seconds(pairs: int, backward: bool = False) -> float:
    flops = 4.0 * pairs * SHAPE.n_heads * SHAPE.head_dim
    if backward:
        return RATES.call_overhead_s + 2.5 * flops / RATES.attention_backward
    return RATES.call_overhead_s + flops / RATES.attention_forward


def test_one_ring_step_by_hand() -> None:
    """te_cp, one sequence of 8 tokens on 2 nodes x 1 GPU: each rank holds 4 tokens
    (zigzag chunks of 2). Step 0: causal over 4 tokens (10 pairs) while the 4 K/V
    rows cross the NIC; step 1: 8 pairs (late queries x all keys, or all queries x
    early keys). The step costs the longer of its compute and its transfer."""
    topo = _topology(2, 1, nic_gbits=0.008)  # 1 MB/s: the transfer dominates
    plan = make_plan(Placement.TE_CP, [8], topo, 4, SHAPE)
    timeline = simulate(layer_graph(_setup(plan), Phase.FORWARD))
    before, after = linear_flops_per_token(SHAPE)
    transfer = topo.inter_node_latency + 4 * ROW_BYTES / topo.nic_bandwidth
    step0 = max(_attention_seconds(10), transfer)
    expected = (4 * before / RATES.matmul) + step0 + _attention_seconds(8) + 4 * after / 2e9
    assert timeline.makespan == pytest.approx(expected, rel=1e-12)
    sends = timeline.intervals(0, Lane.INTER_NODE)
    assert len(sends) == 1 and sends[0][1] - sends[0][0] == pytest.approx(transfer)


def test_one_routed_transfer_by_hand() -> None:
    """A 10-row transfer from rank 1 (node 0) to rank 2 (node 1) on 2 nodes x 2 GPUs
    with one NIC per GPU. Proxies pair by NIC: rows 0-4 go 1 -> 0 (dispatch) -> 2
    (piece into the destination), rows 5-9 go 1 -> 3 (the source's own piece) -> 2
    (combine). Each path is one intra-node and one inter-node hop, run in parallel."""
    topo = _topology(2, 2, nic_gbits=8.0, intra_gbytes=2.0)
    route = plan_route(topo, 1, 2, 10)
    assert set(route.send_proxies) == {0, 1} and set(route.recv_proxies) == {2, 3}
    plan = make_plan(Placement.TE_CP, [16], topo, 4, SHAPE)
    build = _Builder(_setup(plan, routed=True), Phase.FORWARD)
    start = build.graph.join(1, [])
    sent, received = build.ring_transfer(
        Transfer((0, 0, 0), (plan.items()[0].ranks, 1), 1, route), ROW_BYTES, start, start, 0.0
    )
    timeline = simulate(build.graph)
    half = 5 * ROW_BYTES
    intra = topo.intra_node_latency + half / topo.intra_node_bandwidth
    inter = topo.inter_node_latency + half / topo.nic_bandwidth
    assert timeline.makespan == pytest.approx(intra + inter, rel=1e-12)
    assert len(sent) == 2 and len(received) == 2  # a dispatch + own piece; own piece + combine
    pieces = [t for t in build.graph.tasks if t.lane is Lane.INTER_NODE]
    assert sorted((t.rank, t.duration) for t in pieces) == [(0, inter), (1, inter)]


def test_ring_messages_cost_the_latency_of_the_compute_they_overlap() -> None:
    """A calibrated latency curve: 2 ms after no compute, 4 ms after 8 ms; beyond its ends
    the ends hold; without a curve every message is at the topology's latency."""
    topo = _topology(2, 2, intra_gbytes=1.0)
    curved = CostModel(SHAPE, topo, 1e12, message_latency=((0.0, 2e-3), (8e-3, 4e-3)))
    per_byte = 1 / topo.intra_node_bandwidth
    for compute, latency in ((0.0, 2e-3), (4e-3, 3e-3), (8e-3, 4e-3), (1.0, 4e-3)):
        seconds = curved.ring_message_seconds(1000, LinkKind.INTRA_NODE, compute)
        assert seconds == pytest.approx(latency + 1000 * per_byte)
    flat = CostModel(SHAPE, topo, 1e12)
    assert flat.ring_message_seconds(1000, LinkKind.INTRA_NODE, 4e-3) == pytest.approx(
        flat.transfer_seconds(1000, LinkKind.INTRA_NODE, one_sender_per_nic=True)
    )
    assert curved.ring_message_seconds(0, LinkKind.INTRA_NODE, 4e-3) == 0.0


def test_one_remap_by_hand() -> None:
    """hybrid_dp puts a 6-token and a 2-token sequence on the 2 GPUs of one node; the
    remap moves 2 tokens: their q/k/v in and their output back, over the intra-node link."""
    topo = _topology(1, 2, intra_gbytes=0.001)
    plan = make_plan(Placement.HYBRID_DP, [6, 2], topo, 6, SHAPE)
    remap = solve_remap(plan.rank_tokens(), topo, 1)
    assert [t[2] for t in remap.transfers] == [2]
    graph = layer_graph(_setup(plan, remap=remap), Phase.FORWARD)
    timeline = simulate(graph)
    qkv = 2 * (SHAPE.n_heads + 2 * SHAPE.n_kv_heads) * SHAPE.head_dim * 2
    out = 2 * SHAPE.n_heads * SHAPE.head_dim * 2
    durations = {t.name: t.duration for t in graph.tasks if t.name.startswith("remap")}
    latency, bandwidth = topo.intra_node_latency, topo.intra_node_bandwidth
    assert durations["remap q/k/v"] == pytest.approx(latency + qkv / bandwidth)
    assert durations["remap output"] == pytest.approx(latency + out / bandwidth)
    assert timeline.makespan > durations["remap q/k/v"] + durations["remap output"]


def _random_plan(seed: int, strategy: Placement, nodes: int = 2, gpus: int = 4):
    topo = _topology(nodes, gpus, nic_gbits=40.0, intra_gbytes=20.0)
    lengths = batch_lengths("github", nodes * gpus * 256, seed)
    return make_plan(strategy, lengths, topo, 320, SHAPE)


STRATEGIES = [Placement.ZEPPELIN, Placement.TE_CP, Placement.LLAMA_CP, Placement.HYBRID_DP]


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 1000),
    strategy=st.sampled_from(STRATEGIES),
    routed=st.booleans(),
    factor=st.floats(1.5, 8.0),
)
def test_step_time_is_monotone_in_bytes_and_flops(seed, strategy, routed, factor) -> None:
    plan = _random_plan(seed, strategy)

    def step(plan, rates=RATES) -> float:
        run = RunModel(Config(), Hardware(plan.topology, rates), SHAPE, 2)
        return simulate_plan(plan, run, routed).step_seconds

    base = step(plan)
    slower_links = dataclasses.replace(
        plan.topology,
        nic_bandwidth=plan.topology.nic_bandwidth / factor,
        intra_node_bandwidth=plan.topology.intra_node_bandwidth / factor,
    )
    more_bytes = dataclasses.replace(plan, topology=slower_links, _items=None, _by_seq=None)
    assert step(more_bytes) >= base * (1 - 1e-12)
    slower = ComputeRates(*(r / factor for r in (1e9, 0.8e9, 2e9)), 1e-6)
    assert step(plan, slower) >= base * (1 - 1e-12)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.value)
@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.name.lower())
def test_overlap_is_bounded_by_longest_lane_and_serial_time(strategy, phase) -> None:
    """A layer is never faster than any rank's busiest lane (or any NIC's queue) and
    never slower than running every task of the layer one after another."""
    plan = _random_plan(3, strategy)
    graph = layer_graph(_setup(plan, routed=True), phase)
    timeline = simulate(graph)
    for rank in range(plan.world):
        for lane in (Lane.COMPUTE, Lane.INTRA_NODE, Lane.INTER_NODE):
            assert timeline.busy(rank, lane) <= timeline.makespan * (1 + 1e-12)
    assert timeline.makespan <= sum(t.duration for t in graph.tasks) * (1 + 1e-12)
    nic_load: dict = {}
    for task in graph.tasks:
        for resource in task.resources:
            nic_load[resource] = nic_load.get(resource, 0.0) + task.duration
    assert max(nic_load.values()) <= timeline.makespan * (1 + 1e-12)


def test_resources_serve_one_task_at_a_time_and_respect_dependencies() -> None:
    graph = TaskGraph()
    a = graph.add("a", 0, Lane.COMPUTE, 2.0, ("x",))
    b = graph.add("b", 1, Lane.COMPUTE, 1.0, ("x",))
    c = graph.add("c", 1, Lane.COMPUTE, 1.0, ("y",), [a])
    timeline = simulate(graph)
    assert (timeline.start[a], timeline.start[b], timeline.start[c]) == (0.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="depends on task"):
        bad = TaskGraph()
        bad.add("a", 0, Lane.COMPUTE, 1.0, (), [1])
        simulate(bad)


def test_ranks_sharing_cores_compute_faster_while_others_wait_by_hand() -> None:
    """Two ranks on one core (share 0.5 each): a (1 s while both compute) and b (2 s)
    run together for 1 s; then b has 1 s left and the core to itself, twice as fast, so
    it ends at 1.5 s, when the work done (0.5 + 1 core-seconds) has used the core up.
    A transfer after a holds no core and keeps its duration."""
    graph = TaskGraph()
    a = graph.add("a", 0, Lane.COMPUTE, 1.0, (("compute", 0),))
    b = graph.add("b", 1, Lane.COMPUTE, 2.0, (("compute", 1),))
    send = graph.add("send", 0, Lane.INTRA_NODE, 0.25, (("port_out", 0),), [a])
    c = graph.add("c", 1, Lane.COMPUTE, 0.5, (("compute", 1),), [send])
    timeline = simulate(graph, CorePool(2, 0.5))
    assert timeline.end[a] == pytest.approx(1.0)
    assert timeline.end[b] == pytest.approx(1.5)
    assert (timeline.start[c], timeline.end[send]) == (pytest.approx(1.5), pytest.approx(1.25))
    # alone, c runs at one core: 0.5 s at half a core take 0.25 s
    assert timeline.end[c] == pytest.approx(1.75)
    assert simulate(graph).end[c] == pytest.approx(2.5)  # devices of their own: no speed-up
    assert CorePool(4, 0.5).speed(4) == 1.0
    assert CorePool(4, 0.5).speed(1) == 2.0  # one rank takes at most one core
    with pytest.raises(ValueError, match="CorePool"):
        CorePool(4, 0.0)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.value)
@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.name.lower())
def test_shared_cores_play_a_layer_as_the_one_pass_schedule_when_none_speed_up(
    strategy, phase
) -> None:
    """A pool of whole cores, one per rank, never speeds a task up: played event by
    event the layer matches the one-pass schedule task by task; on a pool of half as
    many cores it is never slower, and never faster than its compute work spread over
    those cores."""
    plan = _random_plan(5, strategy)
    graph = layer_graph(_setup(plan, routed=True), phase)
    alone, shared = simulate(graph), simulate(graph, CorePool(plan.world, 1.0))
    np.testing.assert_allclose(shared.start, alone.start, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(shared.end, alone.end, rtol=1e-9, atol=1e-15)
    half = simulate(graph, CorePool(plan.world, 0.5))
    work = sum(t.duration for t in graph.tasks if t.lane is Lane.COMPUTE)  # at 0.5 core
    assert work * 0.5 / (plan.world * 0.5) <= half.makespan * (1 + 1e-9)
    assert half.makespan <= alone.makespan * (1 + 1e-9)


def test_te_cp_round_transfer_matches_fig_12() -> None:
    """Zeppelin paper Fig. 12a: 3B model, 16 GPUs of cluster A, one 64k sequence; TE CP's
    per-round inter-node K/V transfer takes 2.18 ms. Ours must be within 25%."""
    topo = build_topology(TopologyConfig(preset="cluster_a", nodes=2))
    shape = PRESETS["3b"]
    plan = make_plan(Placement.TE_CP, [65536], topo, 4096, shape)
    cost = CostModel(shape, topo, RATES.attention_forward)
    setup = LayerSetup(plan, shape, cost, RATES, RoutingPlan.build(plan, False, all_hops=True))
    timeline = simulate(layer_graph(setup, Phase.FORWARD))
    rounds = [end - start for start, end, _ in timeline.intervals(7, Lane.INTER_NODE)]
    assert len(rounds) == 15
    assert np.mean(rounds) == pytest.approx(2.18e-3, rel=0.25)


def test_simulate_command_writes_table_json_and_pictures(tmp_path, capsys) -> None:
    import json

    from ray_zep.cli import main

    args = ["simulate", "topology.preset=cluster_a", "topology.nodes=2", "model.preset=3b"]
    args += ["--distribution", "arxiv", "--tokens", "64k", "--batches", "1", "--ablation"]
    assert main([*args, "--json", str(tmp_path / "sim.json"), "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "sim.json").read_text())
    rows = record["strategies"]
    assert {"zeppelin", "te_cp", "te_cp+routing", "te_cp+routing+partition"} <= set(rows)
    assert rows["te_cp"]["speedup_vs_te_cp"] == pytest.approx(1.0)
    ideal = record["ideal_step_seconds"]
    assert len(ideal) == 1 and ideal[0] > 0
    for row in rows.values():
        assert row["step_seconds"] > 0 and row["tokens_per_second"] > 0
        assert row["step_over_ideal"] == pytest.approx(row["step_seconds"] / ideal[0])
        assert row["step_over_ideal"] > 1.0
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert (tmp_path / "throughput.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "te_cp+routing+partition" in out and "ideal step" in out
    assert "GPU busy" in out  # every rank's computing share, as in gpu_time_shares
    busy = rows["zeppelin"]["gpu_time_shares"]["computing"]
    assert f"{busy:.2f}" in out.split("\n| zeppelin ")[1].split("\n")[0]
    assert main([*args, "--strategies", "zeppelin,nope"]) == 2
    assert "--strategies: 'nope'" in capsys.readouterr().err


def test_calibration_fit_and_file_round_trip(tmp_path) -> None:
    from ray_zep.bench.calibrate import Measurement, fit
    from ray_zep.errors import ConfigError
    from ray_zep.sim.calibration import Calibration

    points = [Measurement("x", n, 1e9 * n, 2e-5 + n / 50.0) for n in (1, 2, 4, 8)]
    overhead, rate = fit(points)
    assert overhead == pytest.approx(2e-5, rel=1e-6) and rate == pytest.approx(50e9, rel=1e-9)
    calibration = Calibration(RATES, 5e-5, 3e9, measurements=points)
    loaded = Calibration.load(calibration.save(tmp_path / "calibration.json"))
    assert loaded.rates == RATES and loaded.link_bandwidth == 3e9
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a calibration file"):
        ComputeRates.load(tmp_path / "bad.json")
    record = json.loads((tmp_path / "calibration.json").read_text())
    for key, value in (("latency_curve", [1e-3]), ("core_share", "half"), ("ranks", None)):
        (tmp_path / "edited.json").write_text(json.dumps({**record, key: value}))
        with pytest.raises(ConfigError, match=key):
            Calibration.load(tmp_path / "edited.json")


def test_calibration_measures_the_codec_and_the_kernels_score_heads(tmp_path) -> None:
    import torch

    from ray_zep.bench.calibrate_kernels import CODEC_VALUES, curve_heads, measure_codec
    from ray_zep.sim.calibration import Calibration

    cpu = torch.device("cpu")
    codec = measure_codec(cpu, torch.float32, 1)
    assert codec.size == 4 * CODEC_VALUES and 0 < codec.seconds < 5
    # the torch kernel a CPU runs materializes its scores: curves by the tensor's size
    assert curve_heads(SHAPE, cpu) == SHAPE.n_heads
    rates = dataclasses.replace(RATES, codec_bytes_s=1e9, curve_heads=4)
    assert rates.scaled(0.5, "half").codec_bytes_s == 0.5e9
    loaded = Calibration.load(Calibration(rates).save(tmp_path / "calibration.json"))
    assert loaded.rates.curve_heads == 4 and loaded.rates.codec_bytes_s == 1e9


def test_job_share_slows_every_host_cost_measured_outside_the_job(tmp_path) -> None:
    from ray_zep.bench.calibrate import calibration_table
    from ray_zep.sim.calibration import Calibration

    rates = dataclasses.replace(RATES, ring_row_seconds=1e-6, step_overhead_s=0.03)
    bare = Calibration(rates, 5e-5, 3e9, ranks=4, cores=2, core_share=0.5)
    inside = dataclasses.replace(bare, job_share=0.8)
    plain, job = bare.job_rates(4), inside.job_rates(4)
    assert plain.matmul == pytest.approx(0.5 * RATES.matmul)
    assert job.matmul == pytest.approx(0.8 * plain.matmul)
    assert job.attention_rate(4096, True, False) == pytest.approx(
        0.8 * plain.attention_rate(4096, True, False)
    )
    assert job.call_overhead_s == pytest.approx(plain.call_overhead_s / 0.8)
    assert job.ring_row_seconds == pytest.approx(plain.ring_row_seconds / 0.8)
    assert job.step_overhead_s == plain.step_overhead_s == 0.03  # measured inside the job
    assert inside.job_rates(8).matmul == pytest.approx(2 / 8 * RATES.matmul)  # not measured
    # a run whose ranks get half the share they had at calibration: kernels take twice as
    # long, and so do the messages and ring steps measured among the ranks
    slower = dataclasses.replace(bare, ring_step_s=2e-4, run_share=0.25)
    topology = TopologyConfig(preset="virtual", nodes=2, gpus_per_node=2)
    base, half = bare.hardware(topology), slower.hardware(topology)
    assert half.rates.matmul == pytest.approx(0.5 * base.rates.matmul)
    assert half.rates.ring_row_seconds == pytest.approx(2 * base.rates.ring_row_seconds)
    assert half.rates.call_overhead_s == pytest.approx(2 * base.rates.call_overhead_s + 4e-4)
    assert half.intra_latency == pytest.approx(2 * base.intra_latency)
    assert half.intra_bandwidth == pytest.approx(0.5 * base.intra_bandwidth)
    gpu = Calibration(RATES, cores=2)  # no links: a GPU's calibration is not shared
    assert gpu.job_rates(16).matmul == RATES.matmul
    paired = dataclasses.replace(
        inside, job_shares=(0.78, 0.8, 0.83), step_latency_s=1e-3, step_bandwidth=1e9
    )
    loaded = Calibration.load(paired.save(tmp_path / "calibration.json"))
    assert loaded.job_share == 0.8 and loaded.job_shares == (0.78, 0.8, 0.83)
    # the latency by compute between messages is stated at core_share like the messages
    curved = dataclasses.replace(paired, latency_curve=((0.0, 2e-3), (8e-3, 3e-3)))
    reloaded = Calibration.load(curved.save(tmp_path / "curved.json"))
    assert reloaded.latency_curve == ((0.0, 2e-3), (8e-3, 3e-3))
    assert half.message_latency == () and reloaded.hardware(topology).message_latency == (
        pytest.approx((0.0, 2e-3 / 0.8)),
        pytest.approx((8e-3 / 0.8, 3e-3 / 0.8)),
    )
    assert "x0.80 of that (median of 0.78, 0.80, 0.83)" in calibration_table(paired)
    # the virtual cluster's ranks share the cores at the share their compute is stated at
    assert inside.hardware(topology).pool == CorePool(4, 0.5 * 0.8)
    assert gpu.hardware(topology).pool is None


def test_ring_step_costs_are_the_median_of_rounds_one_of_which_ran_slow(monkeypatch) -> None:
    """Three rounds of the engine's layers: two cost 50 us per ring step and 2 us per query
    row beyond the model, one ran 30% slow all over; the calibration keeps 50 us and 2 us."""
    from ray_zep.bench import calibrate_ring
    from ray_zep.config import load_config
    from ray_zep.sim.calibration import Calibration

    config = load_config("conf/demo.yaml", [])
    calibration = Calibration(RATES, 5e-5, 3e9, ranks=4, cores=2, core_share=0.5,
                              alone_step_s=0.1)  # fmt: skip
    modelled = calibrate_ring.modelled_layers(config, calibration.hardware(config.topology))
    steps = 2 * 4  # forward and backward ring steps of 4 ranks
    true = [
        m + steps * (50e-6 + 2e-6 * 2 * c)
        for m, c in zip(modelled, calibrate_ring.CHUNK_TOKENS, strict=True)
    ]
    rounds = [true, [1.3 * t for t in true], true]

    class Probe:
        def around(self, measure, share):
            return measure(), share

    monkeypatch.setattr(calibrate_ring, "measure_layers", lambda config: rounds)
    monkeypatch.setattr(Calibration, "share_probe", lambda self, shape: Probe())
    measured = calibrate_ring.with_ring_step(config, calibration)
    assert measured.ring_step_s == pytest.approx(50e-6 + 2e-6 * 2 * calibrate_ring.CHUNK_TOKENS[0])
    assert measured.rates.ring_row_seconds == pytest.approx(2e-6)


def test_bench_train_rejects_bad_options_before_starting_anything(capsys) -> None:
    from ray_zep.cli import main

    assert main(["bench", "train", "conf/zeppelin.yaml", "--steps", "1"]) == 2
    assert "--steps=1" in capsys.readouterr().err
    assert main(["bench", "train", "conf/zeppelin.yaml", "--strategies", "ring"]) == 2
    assert "--strategies: 'ring'" in capsys.readouterr().err


def test_ideal_step_is_a_balanced_silent_steps_compute() -> None:
    """Equal whole sequences, one per rank: nothing is split or sent but the gradient
    all-reduce, so the simulated step less that all-reduce is the ideal step."""
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=2",
                                "model.preset=7b", "train.tokens_per_rank=5120",
                                "parallel.sequence=whole"])  # fmt: skip
    run = RunModel.create(config, Hardware.preset(build_topology(config.topology)))
    lengths = np.full(16, 4000)
    step = simulate_batch(lengths, run)
    ideal = ideal_step_seconds(lengths, run)
    assert step.step_seconds - step.grad_sync_seconds == pytest.approx(ideal, rel=1e-9)
    # whole sequences of very different work: one rank carries most of the step
    skewed = np.asarray([5120, *([100] * 40)])
    assert simulate_batch(skewed, run).step_seconds > 3 * ideal_step_seconds(skewed, run)


def _segment_seconds(builder, item, layouts, position: int, step: int) -> float:
    """One step's compute costed segment by segment, as the engine cuts it."""
    ring = item.ring_size
    source = (position - step) % ring
    segments = step_segments(layouts[position], layouts[source], step, source, position)
    if not segments:
        return 0.0
    rates, backward = builder.setup.rates, builder.phase is Phase.BACKWARD
    heads = SHAPE.n_heads // item.ulysses
    per_pair = 4.0 * heads * SHAPE.head_dim * (2.5 if backward else 1.0)
    seconds = rates.call_overhead_s + sum(q for _, q, _, _ in segments) * rates.ring_row_seconds
    for _, q, _, k in segments:
        if step == 0:
            flops, length, causal = per_pair * q * (q + 1) / 2, q, True
        else:
            flops, length, causal = per_pair * q * k, (q * k) ** 0.5, False
        seconds += rates.attention_seconds(flops, length, causal, backward, heads=heads)
    return seconds


@pytest.mark.parametrize("placement", [Placement.ZEPPELIN, Placement.TE_CP, Placement.USP])
@pytest.mark.parametrize("curves", [False, True], ids=["half_rate", "curves"])
def test_ring_step_costs_of_a_whole_item_equal_its_segments_costs(placement, curves) -> None:
    rates = dataclasses.replace(RATES, causal_half_tokens=40.0, full_half_tokens=15.0,
                                ring_row_seconds=1e-8)  # fmt: skip
    if curves:
        points = ((4.0, 1e8), (64.0, 6e8), (512.0, 9e8))
        kinds = ("forward_causal", "forward_full", "backward_full")
        curves_of = tuple((kind, points) for kind in kinds)
        rates = dataclasses.replace(rates, curve_heads=4, curves=curves_of)
    lengths = batch_lengths("github", 4 * 300, seed=3) // 3 + 1
    plan = make_plan(placement, lengths, _topology(2, 2), 400, SHAPE)
    for phase in Phase:
        builder = _Builder(_setup(plan, rates), phase)
        for item in plan.items():
            layouts = [position_layout(plan, item, r) for r in range(item.ring_size)]
            at_once = item_layouts(plan, item)  # what the simulator's items read
            assert at_once.tolist() == [[list(slots) for slots in lay] for lay in layouts]
            for position in range(item.ring_size):
                for step in range(item.ring_size):
                    got = builder.step_seconds(item, layouts, position, step)
                    want = _segment_seconds(builder, item, layouts, position, step)
                    assert got == pytest.approx(want, rel=1e-9, abs=1e-15), (item, position, step)


@pytest.mark.parametrize("speed", [1.0, 1e4], ids=["compute_bound", "transfer_bound"])
@pytest.mark.parametrize("message_latency", [False, True], ids=["links", "measured_latency"])
@pytest.mark.parametrize("nodes,gpus", [(1, 4), (2, 4), (4, 2)])
@pytest.mark.parametrize("exchange", [Exchange.RING, Exchange.RING_KEPT], ids=lambda e: e.value)
@pytest.mark.parametrize("grouped", [False, True], ids=["per_message", "grouped"])
def test_a_ring_played_on_arrays_takes_the_event_simulations_times(
    monkeypatch, nodes, gpus, message_latency, speed, exchange, grouped
) -> None:
    """te_cp's global ring of equal chunks: `ring_form`'s recurrence gives every layer the
    makespan the task graph gives, forward and backward (contention and the K/V and
    dK/dV messages queueing on one link included, each message slowing compute or a
    step's two directions once, `ComputeRates.grouped_exchange`); kept, its backward's
    own block last (`kept_ring_backward`)."""
    from ray_zep.sim import ring_form

    rates = dataclasses.replace(
        RATES, contention=1.3, full_half_tokens=20.0, grouped_exchange=grouped
    ).scaled(speed, "")
    world = nodes * gpus
    plan = make_plan(Placement.TE_CP, [2 * world * n for n in (40, 7, 90, 13)],
                     _topology(nodes, gpus), 400, SHAPE)  # fmt: skip
    plan = with_exchange(plan, exchange)
    setup = _setup(plan, rates)
    if message_latency:
        cost = dataclasses.replace(setup.cost, message_latency=((0.0, 2e-5), (1e-3, 9e-5)))
        setup = dataclasses.replace(setup, cost=cost)
    spans = {}
    for threshold in (10**6, 2):
        monkeypatch.setattr(ring_form, "ARRAY_RING", threshold)
        graphs = [layer_graph(setup, phase) for phase in Phase]
        spans[threshold] = [simulate(g).makespan for g in graphs]
        kinds = {t.name for g in graphs for t in g.tasks}
        assert ("attention ring" in kinds) == (threshold == 2)
    assert spans[2] == pytest.approx(spans[10**6], rel=1e-12)


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.name.lower())
def test_a_grouped_exchange_slows_a_ring_step_once_for_its_two_directions(phase) -> None:
    """A ring step's send and receive, one grouped kernel on a GPU, slow the step's
    compute for the longer of the two directions; a calibration's messages (a CPU's)
    each for its own time. te_cp's ring of equal chunks inside one node, compute bound:
    every message is shorter than half the compute it overlaps, so each step is slowed by
    (contention - 1) x what its rank sends under a grouped exchange, twice that
    otherwise, and the presets group their exchanges."""
    topology = _topology(1, 4, intra_gbytes=1e3)
    plan = make_plan(Placement.TE_CP, [4096] * 4, topology, 4096, SHAPE)
    slowed = {}
    for grouped in (False, True):
        rates = dataclasses.replace(RATES, contention=1.5, grouped_exchange=grouped)
        graph = layer_graph(_setup(plan, rates), phase)
        steps = [t for t in graph.slowed if graph.tasks[t].name.startswith("attention step")]
        assert steps, "no ring step overlapped a message"
        for t in steps:  # below the cap, (contention - 1) x the whole step's compute
            alone = graph.tasks[t].duration - graph.slowed[t]
            assert 0 < graph.slowed[t] < 0.5 * alone
        slowed[grouped] = {t: graph.slowed[t] for t in steps}
    assert slowed[True].keys() == slowed[False].keys()
    for task, once in slowed[True].items():
        assert slowed[False][task] == pytest.approx(2 * once, rel=1e-9)
    cluster_a = build_topology(TopologyConfig(preset="cluster_a"))
    assert Hardware.preset(cluster_a).rates.grouped_exchange


@pytest.mark.parametrize("latency_share", [0.0, 0.8])
def test_a_weight_collective_leaves_the_links_free_for_its_latency_and_shares_them_after(
    latency_share,
) -> None:
    """te_cp on 2 nodes x 1 GPU with a forward weight all-gather posted at the layer's
    start: its ring steps' latency holds no link, so the ring's K/V crosses the NIC alone
    during it; after it, the K/V shares the link with the gather's bytes, each at half
    pace, and the gather ends as much later as the K/V takes alone."""
    topo = _topology(2, 1, nic_gbits=0.008)
    plan = make_plan(Placement.TE_CP, [8], topo, 4, SHAPE)
    transfer = topo.inter_node_latency + 4 * ROW_BYTES / topo.nic_bandwidth
    sync = 10 * transfer
    latency = latency_share * sync
    setup = dataclasses.replace(
        _setup(plan), weight_sync=(sync, 0.0), weight_latency=(latency, 0.0),
        weight_groups=((0, 1),),
    )  # fmt: skip
    timeline = simulate(layer_graph(setup, Phase.FORWARD))
    sends = timeline.intervals(0, Lane.INTER_NODE)
    gather = [(a, b) for a, b, name in sends if name == "weights gather/scatter"]
    (kv,) = [(a, b) for a, b, name in sends if name == "K/V"]
    (alone,) = [t.duration for t in timeline.graph.tasks if t.name == "K/V" and t.rank == 0]
    assert len(gather) == 1 and gather[0][0] == pytest.approx(latency)
    if latency_share:
        assert kv[1] <= latency, "the K/V waited for a collective's latency"
        assert gather[0][1] == pytest.approx(sync)
    else:
        assert kv[1] - kv[0] == pytest.approx(2 * alone), "half the link while both run"
        assert gather[0][1] == pytest.approx(sync + alone)


def test_fsdp_weight_collectives_carry_their_ring_steps_latency() -> None:
    """A block's FSDP2 all-gather over W ranks has W - 1 ring steps' latency; backward
    gathers again and reduce-scatters: twice that, or, with the blocks kept on the node
    (`parallel.reshard_to_node`, unset: room for them here), the reduce-scatter's and the
    node's gather's G - 1 steps. Each is part of its collective's time."""
    keys = ["topology.preset=cluster_a", "topology.nodes=4", "model.preset=7b",
            "parallel.weights=fsdp"]  # fmt: skip
    for extra, node in (([], True), (["parallel.reshard_to_node=false"], False)):
        config = load_config(None, [*keys, *extra])
        run = RunModel.create(config, Hardware.preset(build_topology(config.topology)))
        paid = weights_of(run)
        cost = run.hardware.cost(run.shape)
        one = cost.all_gather_seconds(0.0, range(32))
        inside = cost.all_gather_seconds(0.0, range(8))
        assert 0 < inside < one and paid.regather_in_node is node
        assert paid.layer_latency == pytest.approx((one, one + (inside if node else one)))
        assert all(lat < sync for lat, sync in zip(paid.layer_latency, paid.layer_sync,
                                                   strict=True))  # fmt: skip


def test_a_collective_across_nodes_moves_on_each_link_for_its_own_bytes() -> None:
    """A weight collective over two nodes runs at its NICs' pace: it moves on every NIC
    for all of its time after the latency, and on a member's port only for the share of it
    the port's bandwidth needs for the same bytes (a port twice as fast: half)."""
    topo = _topology(2, 2, nic_gbits=8.0, intra_gbytes=4.0)  # 2 NICs x 1 GB/s; 4 GB/s ports
    plan = make_plan(Placement.TE_CP, [16], topo, 8, SHAPE)
    world = tuple(range(topo.world_size))
    setup = dataclasses.replace(_setup(plan), weight_sync=(0.3, 0.5), weight_groups=(world,),
                                weight_latency=(0.1, 0.1))  # fmt: skip
    share = topo.nics_per_node * topo.nic_bandwidth / topo.intra_node_bandwidth
    assert share == pytest.approx(0.5)
    for phase, seconds in ((Phase.FORWARD, 0.3), (Phase.BACKWARD, 0.5)):
        parts = [t for t in layer_graph(setup, phase).tasks if t.name == "weights gather/scatter"]
        nics = [t.duration for t in parts if t.lane is Lane.INTER_NODE]
        ports = [t.duration for t in parts if t.lane is Lane.INTRA_NODE]
        assert len(nics) == topo.nodes * topo.nics_per_node  # one part a link
        assert len(ports) == topo.world_size
        assert nics == pytest.approx([seconds - 0.1] * len(nics))
        assert ports == pytest.approx([(seconds - 0.1) * share] * len(ports))
    inside = dataclasses.replace(setup, weight_groups=((0, 1), (2, 3)))
    parts = [
        t for t in layer_graph(inside, Phase.FORWARD).tasks if t.name == "weights gather/scatter"
    ]
    assert sum(t.duration for t in parts) == pytest.approx(4 * 0.2), "inside a node: all of it"
    assert len(parts) == 4


def test_a_ulysses_all_to_all_pays_its_messages_latency_side_by_side() -> None:
    """USP on 2 nodes x 4 GPUs: a Ulysses exchange goes as one batch of all pairs, played
    as one part per member and link kind (an all-to-all-v, as the remap's) that carries
    the link's latency apart from its bytes (`Task.latency`, holding no link), and a ring
    hop none; with a latency far above the bytes' time, the forward's exchange into the
    heads ends one latency after its bytes, not one per message sharing the port."""
    topo = dataclasses.replace(_topology(2, 4), intra_node_latency=1e-3)
    plan = make_plan(Placement.USP, [64, 48], topo, 40, SHAPE)
    assert any(item.ulysses > 1 for item in plan.items())
    graph = layer_graph(_setup(plan), Phase.FORWARD)
    ulysses = [t for t in graph.tasks if t.name == "Ulysses in" and t.duration > 0]
    hops = [t for t in graph.tasks if t.name == "K/V" and t.duration > 0]
    assert ulysses and hops
    assert all(t.latency == pytest.approx(1e-3) for t in ulysses)
    assert all(t.latency == 0.0 for t in hops)
    timeline = simulate(graph)
    first = min(i for i, t in enumerate(graph.tasks) if t.name == "Ulysses in")
    rank = graph.tasks[first].rank
    own = [i for i, t in enumerate(graph.tasks)
           if t.name == "Ulysses in" and t.rank == rank and t.duration > 0]  # fmt: skip
    assert len(own) == 1, "one part for the rank's messages inside its node"
    start = min(timeline.start[i] for i in own)
    span = max(timeline.end[i] for i in own) - start
    bytes_s = sum(graph.tasks[i].duration - graph.tasks[i].latency for i in own)
    assert span <= 1e-3 + bytes_s + 1e-12 < 2e-3
