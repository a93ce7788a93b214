"""The composed simulator: every composition the trainer runs, from the plan it executes."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_zep.bench.calibrate_links import (
    LinkPoint,
    contention,
    fit_link,
    latency_curve,
    median_points,
)
from ray_zep.config import Compression, Config, load_config
from ray_zep.costmodel import ComputeRates
from ray_zep.data.synthetic import batch_lengths
from ray_zep.parallel.axes import Placement, WeightsMode
from ray_zep.sim.events import CorePool
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel, greedy_bins, plan_batch, simulate_batch, simulate_plan
from ray_zep.step_plan import plan_step
from ray_zep.topology import build_topology
from tests.helpers.scenarios import WHOLE_EXCHANGES

pytestmark = pytest.mark.unit

CURVES = (
    ("forward_causal", ((32.0, 1e9), (512.0, 4e9))),
    ("backward_causal", ((32.0, 0.5e9), (512.0, 2e9))),
)
RATES = ComputeRates(
    4e9, 2e9, 8e9, 1e-5, "test", 64.0, 32.0, 1.2, CURVES, 1e9, 1e-9, 1e-3, 1e-4, 1e-7, 2e10
)
"""A codec at 20 GB/s: zipping pays on these links' slower messages, not on all."""
PLACED = [
    Placement.WHOLE,
    Placement.ZEPPELIN,
    Placement.TE_CP,
    Placement.LLAMA_CP,
    Placement.HYBRID_DP,
    Placement.USP,
]
AUTOGRAD_WEIGHTS = [WeightsMode.REPLICATED, WeightsMode.FSDP, WeightsMode.HSDP]


@functools.cache
def _config(placement: Placement, weights: WeightsMode) -> Config:
    routed = placement is Placement.ZEPPELIN
    overrides = [
        f"parallel.sequence={placement.value}",
        f"parallel.weights={weights.value}",
        f"parallel.routing={str(routed).lower()}",
        f"parallel.remap={str(routed).lower()}",
        "parallel.ulysses_degree=2",
        "train.tokens_per_rank=1024",
        "topology.nic_gbits_per_s=8",
        "topology.intra_node_gbytes_per_s=4",
    ]
    if placement is Placement.WHOLE:
        overrides.append("data.packing=rank")
    return load_config("conf/demo.yaml", overrides)


def _run(
    placement: Placement,
    weights: WeightsMode,
    rates=RATES,
    compression: Compression = Compression.OFF,
    pool: CorePool | None = None,
    **links,
) -> RunModel:
    config = _config(placement, weights)
    config = dataclasses.replace(
        config, comm=dataclasses.replace(config.comm, compression=compression)
    )
    topology = dataclasses.replace(build_topology(config.topology), **links)
    return RunModel.create(config, Hardware(topology, rates, pool=pool), on_gpu=False)


def _lengths(seed: int) -> np.ndarray:
    """A batch of 2048 tokens: a few long sequences and short ones, varied by seed."""
    rng = np.random.default_rng(seed)
    lengths, left = [], 4 * 512
    while left > 0:
        n = int(min(left, rng.choice([rng.integers(1, 64), rng.integers(64, 900)])))
        lengths.append(n)
        left -= n
    return np.asarray(lengths, dtype=np.int64)


def _step(run: RunModel, lengths: np.ndarray) -> float:
    return simulate_batch(lengths, run, greedy_bins(lengths, 4)).step_seconds


SLOWER = {
    "nic_bandwidth": ("link", 0.5),
    "intra_node_bandwidth": ("link", 0.5),
    "inter_node_latency": ("link", 3.0),
    "intra_node_latency": ("link", 3.0),
    "attention_forward": ("rate", 0.5),
    "attention_backward": ("rate", 0.5),
    "matmul": ("rate", 0.5),
    "pointwise": ("rate", 0.5),
    "curves": ("rate", 0.5),
    "contention": ("rate", 2.0),
    "call_overhead_s": ("rate", 3.0),
    "optimizer_param_seconds": ("rate", 3.0),
    "step_overhead_s": ("rate", 3.0),
    "fsdp_unit_overhead_s": ("rate", 3.0),
    "ring_row_seconds": ("rate", 3.0),
    "codec_bytes_s": ("rate", 0.5),
}


def _slower(name: str, factor: float, topology) -> tuple[dict, ComputeRates]:
    kind, base = SLOWER[name]
    scale = base**factor
    if kind == "link":
        return {name: getattr(topology, name) * scale}, RATES
    if name == "curves":
        slower = tuple((k, tuple((n, r * scale) for n, r in pts)) for k, pts in RATES.curves)
        return {}, dataclasses.replace(RATES, curves=slower)
    return {}, dataclasses.replace(RATES, **{name: getattr(RATES, name) * scale})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 500),
    placement=st.sampled_from(PLACED),
    weights=st.sampled_from(AUTOGRAD_WEIGHTS),
    knob=st.sampled_from(sorted(SLOWER)),
    factor=st.floats(0.5, 2.0),
    compression=st.sampled_from(list(Compression)),
    pool=st.sampled_from([None, CorePool(4, 0.5)]),
)
def test_step_time_never_drops_when_a_link_or_rate_gets_worse(
    seed, placement, weights, knob, factor, compression, pool
) -> None:
    """The same plan on worse hardware (the planners may choose differently on other
    hardware: that is a decision, not the simulator's arithmetic), with ZipCCL off or on,
    on devices of their own or on a CPU virtual cluster's shared cores: where a slower
    link tips a message to the zipped path, that path takes as long as the plain one did
    at the tipping point."""
    lengths = _lengths(seed)
    run = _run(placement, weights, compression=compression, pool=pool)
    plan, remap = plan_batch(lengths, run, greedy_bins(lengths, 4))
    routed = run.config.parallel.routing
    base = simulate_plan(plan, run, routed, remap).step_seconds
    links, rates = _slower(knob, factor, run.hardware.topology)
    worse_run = _run(placement, weights, rates, compression, pool, **links)
    worse_plan = dataclasses.replace(
        plan, topology=worse_run.hardware.topology, _items=None, _by_seq=None
    )
    worse = simulate_plan(worse_plan, worse_run, routed, remap).step_seconds
    assert worse >= base * (1 - 1e-9), f"{knob} x{factor}: {worse} < {base}"


@pytest.mark.parametrize("mode", [WeightsMode.TAWPIPE, WeightsMode.RING_RELAY])
def test_weight_passing_steps_slow_down_with_their_links(mode) -> None:
    lengths = _lengths(3)
    run = _run(Placement.WHOLE, mode)
    base = _step(run, lengths)
    nic = run.hardware.topology.nic_bandwidth
    slow = _step(_run(Placement.WHOLE, mode, nic_bandwidth=nic / 8), lengths)
    assert slow > base > 0


def test_fsdp_on_free_links_costs_what_replicated_computes_and_its_gathers_show_when_slow():
    lengths = _lengths(7)
    free = {"nic_bandwidth": 1e30, "intra_node_bandwidth": 1e30}
    free |= {"inter_node_latency": 0.0, "intra_node_latency": 0.0}
    rates = dataclasses.replace(RATES, fsdp_unit_overhead_s=0.0, optimizer_param_seconds=0.0)
    replicated = simulate_batch(
        lengths, _run(Placement.TE_CP, WeightsMode.REPLICATED, rates, **free)
    )
    fsdp = simulate_batch(lengths, _run(Placement.TE_CP, WeightsMode.FSDP, rates, **free))
    assert fsdp.step_seconds == pytest.approx(replicated.step_seconds, rel=1e-9)
    slow = {"nic_bandwidth": 1e6, "intra_node_bandwidth": 1e6}
    sharded = simulate_batch(lengths, _run(Placement.TE_CP, WeightsMode.FSDP, rates, **slow))
    assert sharded.grad_sync_seconds > 0
    assert sharded.forward_layer_seconds > fsdp.forward_layer_seconds


def test_hsdp_all_reduces_each_block_across_nodes_beside_the_backward() -> None:
    """FSDP2's HSDP all-reduces a block's reduced shard with the other nodes' replicas
    right after its reduce-scatter, on its own stream: in the blocks' backward sync,
    over every node's NICs, and only the last block's, the embedding's and the head's
    after backward."""
    from ray_zep.costmodel import GRAD_BYTES_PER_ELEMENT
    from ray_zep.parallel.memory import block_params
    from ray_zep.sim.step import weights_of

    run = _run(Placement.TE_CP, WeightsMode.HSDP)
    paid = weights_of(run)
    topology, shape, cost = run.hardware.topology, run.shape, run.hardware.cost(run.shape)
    assert topology.nodes > 1 and paid.backward_groups == (tuple(range(topology.world_size)),)
    gpus = topology.gpus_per_node
    replicas = list(range(0, topology.world_size, gpus))
    block = float(np.mean([block_params(shape, i) for i in range(shape.n_layers)]))
    scatter = cost.all_gather_seconds(block / gpus * GRAD_BYTES_PER_ELEMENT, range(gpus))
    across = cost.all_reduce_seconds(block * GRAD_BYTES_PER_ELEMENT, replicas)
    assert paid.layer_sync[1] == pytest.approx(paid.layer_sync[0] + scatter + across, rel=1e-12)
    whole = cost.all_reduce_seconds(shape.param_count() * GRAD_BYTES_PER_ELEMENT, replicas)
    assert paid.exposed < whole, "not every gradient after backward"
    # on free links the blocks' collectives hide entirely, as fsdp's do
    lengths = _lengths(7)
    free = {"nic_bandwidth": 1e30, "intra_node_bandwidth": 1e30}
    free |= {"inter_node_latency": 0.0, "intra_node_latency": 0.0}
    rates = dataclasses.replace(RATES, fsdp_unit_overhead_s=0.0, optimizer_param_seconds=0.0)
    steps = [simulate_batch(lengths, _run(Placement.TE_CP, mode, rates, **free)).step_seconds
             for mode in (WeightsMode.REPLICATED, WeightsMode.HSDP)]  # fmt: skip
    assert steps[1] == pytest.approx(steps[0], rel=1e-9)


def test_the_simulator_places_a_batch_as_the_data_actor_does() -> None:
    lengths = _lengths(11)
    run = _run(Placement.ZEPPELIN, WeightsMode.FSDP)
    step = simulate_batch(lengths, run)
    planned = plan_step(lengths, run.config, run.hardware.topology, run.shape)
    assert (step.remap is None) == (planned.remap is None)
    if step.remap is not None:
        assert step.remap.counts_after == planned.remap.counts_after
    assert step.tokens == int(lengths.sum())
    plan, remap = plan_batch(lengths, run)  # the plan alone: no routing, no traffic counted
    assert plan.placements == planned.attention.placements
    assert (remap is None) == (planned.remap is None)


def test_attention_rates_follow_the_measured_curve_and_survive_a_file(tmp_path) -> None:
    assert RATES.attention_rate(32, True, False) == pytest.approx(1e9)
    assert RATES.attention_rate(128, True, False) == pytest.approx(2e9)  # log-log midpoint
    assert RATES.attention_rate(1e6, True, False) == pytest.approx(4e9)  # flat past the end
    # no curve for unmasked forward blocks: the half-rate form, L / (L + 32)
    assert RATES.attention_rate(32, False, False) == pytest.approx(2e9)
    half = RATES.scaled(0.5, "half")
    assert half.attention_rate(128, True, True) == pytest.approx(
        0.5 * RATES.attention_rate(128, True, True)
    )
    assert ComputeRates.load(RATES.save(tmp_path / "rates.json")) == RATES


def test_a_kernel_bound_by_its_score_tensor_reads_its_curve_at_the_calls_heads() -> None:
    """The CPU reference kernel materializes heads x queries x keys scores: a call with a
    quarter of the calibration's heads runs like one half as long (the same tensor);
    flash-attn's curves (curve_heads 0) follow the length whatever the heads."""
    cpu = dataclasses.replace(RATES, curve_heads=4)
    half = RATES.attention_rate(128, True, False)
    assert cpu.attention_rate(256, True, False, heads=1) == pytest.approx(half)
    assert cpu.attention_rate(256, True, False, heads=4) == RATES.attention_rate(256, True, False)
    assert cpu.attention_rate(256, True, False) == RATES.attention_rate(256, True, False)
    assert RATES.attention_rate(256, True, False, heads=1) == RATES.attention_rate(256, True, False)
    # usp's members call the kernel with H / U heads (tiny: 4 heads, U = 2), te_cp with all
    lengths = np.array([2048])
    for placement, slower in ((Placement.USP, True), (Placement.TE_CP, False)):
        by_length = simulate_batch(lengths, _run(placement, WeightsMode.REPLICATED))
        by_tensor = simulate_batch(lengths, _run(placement, WeightsMode.REPLICATED, cpu))
        # these curves rise with the length: a shorter reading is a slower kernel
        assert (by_tensor.step_seconds > by_length.step_seconds) is slower
        assert by_tensor.step_seconds >= by_length.step_seconds


def test_link_fits_and_contention_from_measured_points() -> None:
    points = [LinkPoint("message", n, 1e-3 + n / 1e9) for n in (1 << 12, 1 << 18, 1 << 21)]
    latency, bandwidth = fit_link(points, "message")
    assert latency == pytest.approx(1e-3, rel=1e-6) and bandwidth == pytest.approx(1e9, rel=1e-6)
    hidden = [LinkPoint("overlapped_message", p.nbytes, p.seconds / 4) for p in points]
    assert contention(points + hidden) == pytest.approx(1.25)
    assert contention(points) == 1.0
    # three rounds: each point is the median of its own three measurements
    rounds = [LinkPoint(p.op, p.nbytes, p.seconds * f) for f in (1.0, 3.0, 0.9) for p in points]
    assert median_points(rounds) == points
    # the smallest message after shorter bursts too: the latency by the compute before it
    after = [LinkPoint("message_after", 1 << 12, s, m, c) for m, c, s in ((0, 1e-5, 4e-4),
             (3, 2e-3, 6e-4), (0, 3e-5, 2e-4), (3, 4e-3, 7e-4))]  # fmt: skip
    burst = LinkPoint("burst", 1 << 12, 8e-3)
    medians = median_points([*after, burst])
    assert [(p.burst, p.seconds, p.compute_s) for p in medians[:2]] == [
        (0, pytest.approx(3e-4), pytest.approx(2e-5)),
        (3, pytest.approx(6.5e-4), pytest.approx(3e-3)),
    ]
    curve = latency_curve(points + medians, latency, bandwidth)
    per_message = (1 << 12) / bandwidth
    assert curve == (
        (pytest.approx(2e-5), pytest.approx(3e-4 - per_message)),
        (pytest.approx(3e-3), pytest.approx(6.5e-4 - per_message)),
        (8e-3, pytest.approx(1e-3)),
    )
    assert latency_curve(points, latency, bandwidth) == ()  # short bursts not measured


def test_activation_checkpointing_adds_what_backward_recomputes() -> None:
    """`full` plays every block's forward again, ring exchange included; `linears` only the
    projections and `selective` only the feed-forward part, so they cost less; the step's
    parts still add up to it."""
    from ray_zep.options import ActivationCheckpointing as Mode
    from ray_zep.sim.checkpointing import with_checkpointing
    from ray_zep.sim.layer_work import recomputed_seconds

    base = _run(Placement.ZEPPELIN, WeightsMode.FSDP)
    lengths = _lengths(3)
    plan, remap = plan_batch(lengths, base)
    steps = {}
    for mode in Mode:
        run = dataclasses.replace(base, config=with_checkpointing(base.config, mode))
        steps[mode] = simulate_plan(plan, run, True, remap)
    plain, selective, full = steps[Mode.NONE], steps[Mode.SELECTIVE], steps[Mode.FULL]
    linears = steps[Mode.LINEARS]
    layers = base.shape.n_layers
    assert plain.recompute_seconds == 0.0
    assert full.recompute_seconds == pytest.approx(layers * plain.forward_layer_seconds)
    assert full.step_seconds == pytest.approx(plain.step_seconds + full.recompute_seconds)
    assert 0 < selective.recompute_seconds < linears.recompute_seconds < full.recompute_seconds
    # each rank recomputes its own tokens inside the backward, where this batch's
    # ranks with fewer tokens or slack hide part of it: the step pays no more than the
    # fullest rank's recomputation alone, block by block (not a law: a recomputation that
    # delays a ring's start can cost its peers more)
    most = max(plan.rank_tokens() if remap is None else remap.counts_after)
    for mode in (Mode.SELECTIVE, Mode.LINEARS):
        alone = recomputed_seconds(base.shape, mode, most, base.hardware.rates)
        assert steps[mode].recompute_seconds <= layers * alone * (1 + 1e-9), mode
    for step in steps.values():
        assert sum(step.breakdown(layers).values()) == pytest.approx(step.step_seconds)
    # on the first block only (train.checkpoint_blocks=1): that block's share
    for mode in (Mode.FULL, Mode.SELECTIVE, Mode.LINEARS):
        run = dataclasses.replace(base, config=with_checkpointing(base.config, mode, 1))
        one = simulate_plan(plan, run, True, remap)
        assert one.recompute_seconds == pytest.approx(steps[mode].recompute_seconds / layers)
    # full on the first block, selective on the rest (train.checkpoint_rest): the shares add
    config = with_checkpointing(base.config, Mode.FULL, 1, Mode.SELECTIVE)
    mixed = simulate_plan(plan, dataclasses.replace(base, config=config), True, remap)
    want = (full.recompute_seconds + (layers - 1) * selective.recompute_seconds) / layers
    assert mixed.recompute_seconds == pytest.approx(want)


def test_a_remap_exchange_costs_its_busiest_link_not_a_queue_across_the_cluster() -> None:
    """64 GPUs of cluster A, a chat batch whose remap moves ~20k tokens between nodes:
    the forward layer with the remap takes about what the remapping layer's own cost
    estimate says its exchanges take beyond the layer without it (messages played pair
    by pair queued behind each other's NICs and cost ~20x that). Since a batch's
    messages pay their latency side by side (`ray_zep.sim.events`), the layer without
    the remap takes 32.2 ms and the one with it 33.2 ms: the remap adds 1.0 ms where
    its estimate, one latency a rank, says 2.6 (it added 3.0 ms for an estimate of 2.8
    with a latency a message): within 1.25x."""
    from ray_zep.remap.policy import remap_cost_seconds

    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=8",
                                "model.preset=7b", "train.tokens_per_rank=5120",
                                "parallel.weights=fsdp", "parallel.sequence=zeppelin",
                                "parallel.routing=true",
                                "parallel.remap=true", "parallel.remap_policy=always",
                                WHOLE_EXCHANGES])  # fmt: skip
    run = RunModel.create(config, Hardware.preset(build_topology(config.topology)))
    plan, remap = plan_batch(batch_lengths("chat", 4096 * 64, 0), run)
    assert remap is not None and len(remap.transfers) > 20
    with_remap = simulate_plan(plan, run, True, remap).forward_layer_seconds
    without = simulate_plan(plan, run, True, None).forward_layer_seconds
    forward_cost = remap_cost_seconds(remap, plan.topology, run.shape) / 2
    assert with_remap - without <= 1.25 * forward_cost


def test_a_remap_that_would_expose_the_usp_exchanges_is_not_chosen() -> None:
    """The same 64 GPUs and chat batch, USP head exchanges in pieces (the default): the
    plan's 64-rank group hides its exchanges beside its projections, which a remap undoes
    (the engine then exchanges whole). Remapping plays slower; the policy's gain beats the
    remap's own exchanges but not those plus what the pieces hid, so `when_faster` keeps
    the plan's layout. Exchanges already whole lose nothing."""
    from ray_zep.config import RemapPolicy
    from ray_zep.costmodel import preset_rates
    from ray_zep.partition.stats import attention_seconds
    from ray_zep.remap.policy import (
        choose_remap,
        lost_overlap_seconds,
        remap_cost_seconds,
        remap_gain_seconds,
    )

    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=8",
                                "model.preset=7b", "train.tokens_per_rank=5120",
                                "parallel.weights=fsdp", "parallel.sequence=zeppelin",
                                "parallel.routing=true", "parallel.remap=true",
                                "parallel.remap_policy=always"])  # fmt: skip
    run = RunModel.create(config, Hardware.preset(build_topology(config.topology)))
    plan, remap = plan_batch(batch_lengths("chat", 4096 * 64, 0), run)
    assert any(item.ulysses > 1 for item in plan.items())
    pieces = config.parallel.ulysses_pieces
    assert pieces > 1
    slower = simulate_plan(plan, run, True, remap).step_seconds
    assert slower > simulate_plan(plan, run, True, None).step_seconds
    rates = preset_rates(plan.topology.gpu_model)
    gain = remap_gain_seconds(remap, attention_seconds(plan, run.shape), run.shape, rates)
    lost = lost_overlap_seconds(plan, run.shape, rates, pieces)
    own = remap_cost_seconds(remap, plan.topology, run.shape)
    assert own < gain  # remapped before
    assert own + lost > gain
    assert choose_remap(plan, run.shape, rates, RemapPolicy.WHEN_FASTER, pieces) is None
    assert lost_overlap_seconds(plan, run.shape, rates, 1) == 0.0


def test_dkv_in_the_kv_dtype_halves_the_backward_accumulators_bytes() -> None:
    """`parallel.dkv_wire=compute`: the simulator sends dK/dV in the activation dtype and
    the work model weighs a backward ring step at twice the forward bytes, not three
    times; a transfer-bound ring across nodes (on 100 Gbit/s NICs) then plays its
    backward faster."""
    from ray_zep.options import DkvWire
    from ray_zep.partition.plan import AttentionPlan, SeqPlacement, even_bounds
    from ray_zep.partition.work import WorkModel

    base = load_config(None, ["topology.preset=cluster_a", "topology.nodes=2",
                              "topology.nic_gbits_per_s=100",
                              "model.preset=7b", "train.tokens_per_rank=8192",
                              "parallel.sequence=zeppelin", "parallel.routing=true"])  # fmt: skip
    topology = build_topology(base.topology)
    steps = {}
    for wire in DkvWire:
        parallel = dataclasses.replace(base.parallel, dkv_wire=wire)
        run = RunModel.create(dataclasses.replace(base, parallel=parallel),
                              Hardware.preset(topology))  # fmt: skip
        assert run.dkv_bytes == (run.element_bytes if wire is DkvWire.COMPUTE else 4)
        model = WorkModel.create(run.shape, topology, routed=True, dkv_wire=wire)
        assert model.dkv_factor == (2.0 if wire is DkvWire.COMPUTE else 3.0)
        ring = SeqPlacement(0, 65536, tuple(range(16)), even_bounds(65536, 16))
        plan = AttentionPlan(Placement.ZEPPELIN, topology, 8192, (ring,))
        steps[wire] = simulate_plan(plan, run, True, None)
    fast, slow = steps[DkvWire.COMPUTE], steps[DkvWire.FLOAT32]
    assert fast.forward_layer_seconds == pytest.approx(slow.forward_layer_seconds)
    assert fast.backward_layer_seconds < 0.9 * slow.backward_layer_seconds


def test_dkv_sent_to_their_owners_halves_their_bytes_and_unchains_the_backward() -> None:
    """`parallel.dkv_wire=owner` (the default): a ring inside a node and a USP group over
    two nodes send each step's dK/dV to their owners in the activation dtype. Their
    forward is unchanged, their backward shorter than with float32 accumulators, the
    USP group's dK/dV bytes over the NICs a quarter of them (R = 2: each member sends
    the other position's rows once, in bf16, where the ring sends both positions' in
    float32), and the work model costs both members lower; a ring across nodes keeps
    float32 accumulators and plays as before."""
    from ray_zep.options import DkvWire
    from ray_zep.partition.plan import AttentionPlan, SeqPlacement, even_bounds
    from ray_zep.partition.work import WorkModel
    from ray_zep.traffic import attention_step_traffic

    base = load_config(None, ["topology.preset=cluster_a", "topology.nodes=2",
                              "model.preset=7b", "train.tokens_per_rank=8192",
                              "parallel.sequence=zeppelin", "parallel.routing=true"])  # fmt: skip
    topology = build_topology(base.topology)
    n = 65536
    inside = SeqPlacement(0, n, tuple(range(8)), even_bounds(n, 8))
    usp = SeqPlacement(0, n, tuple(range(16)), even_bounds(n, 2), ulysses=8)
    across = SeqPlacement(0, n, tuple(range(4, 12)), even_bounds(n, 8))
    runs = {}
    for wire in (DkvWire.FLOAT32, DkvWire.OWNER):
        parallel = dataclasses.replace(base.parallel, dkv_wire=wire)
        runs[wire] = RunModel.create(dataclasses.replace(base, parallel=parallel),
                                     Hardware.preset(topology))  # fmt: skip
    assert base.parallel.dkv_wire is DkvWire.OWNER
    steps, inter = {}, {}
    for name, seq in (("inside", inside), ("usp", usp), ("across", across)):
        plan = AttentionPlan(Placement.ZEPPELIN, topology, 8192, (seq,))
        (item,) = plan.items()
        assert item.owner_dkv == (name != "across"), name
        for wire, run in runs.items():
            steps[name, wire] = simulate_plan(plan, run, True, None)
            owner = run.dkv_owner
            inter[name, wire] = attention_step_traffic(plan, run.shape, True, None,
                                                       dkv_owner=owner).inter_node  # fmt: skip
        fast, slow = steps[name, DkvWire.OWNER], steps[name, DkvWire.FLOAT32]
        assert fast.forward_layer_seconds == pytest.approx(slow.forward_layer_seconds), name
        if name == "across":
            assert fast.backward_layer_seconds == pytest.approx(slow.backward_layer_seconds)
        else:
            assert fast.backward_layer_seconds < slow.backward_layer_seconds, name
    shape = runs[DkvWire.OWNER].shape
    elements = n * shape.n_layers * 2 * shape.n_kv_heads * shape.head_dim  # K/V, all layers
    # dK/dV: both positions' hops carry every position's rows in float32, or each position
    # sends the other's half of them in bf16 (K/V's bytes are the same under both)
    saved = inter["usp", DkvWire.FLOAT32] - inter["usp", DkvWire.OWNER]
    assert saved == 2 * elements * 4 - elements * 2
    for wire in (DkvWire.FLOAT32, DkvWire.OWNER):
        assert inter["inside", wire] == 0
    models = {w: WorkModel.create(shape, topology, routed=True, dkv_wire=w) for w in runs}
    lengths, nodes = np.asarray([n]), np.asarray([2])
    usp_s = {w: m.usp_member_seconds(lengths, nodes)[0] for w, m in models.items()}
    assert usp_s[DkvWire.OWNER] < usp_s[DkvWire.FLOAT32]
    ring_s = {w: m.alone_ring_seconds(lengths, np.asarray([8]))[0] for w, m in models.items()}
    assert ring_s[DkvWire.OWNER] <= ring_s[DkvWire.FLOAT32]


def test_a_block_gathers_the_next_one_after_its_attention_so_the_ring_has_the_nics() -> None:
    """64 GPUs of cluster A, 13b under FSDP over every rank, a prolong64k batch whose
    long documents run on rings across nodes: FSDP2 gathering the next block when a block
    starts holds every NIC while the ring's first K/V wait for them; gathered once the
    block's attention is done (`parallel.prefetch_after_attention`, which the cost model
    chooses here, as the trainer runs it), the gather starts after every rank's last
    attention step and the forward layer is shorter. The baselines keep FSDP2's own
    timing."""
    steps = {}
    for after in (True, False):
        unset_or_off = "null" if after else "false"
        config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=8",
                                    "model.preset=13b", "train.tokens_per_rank=5120",
                                    "parallel.weights=fsdp", "parallel.sequence=zeppelin",
                                    "parallel.routing=true", "parallel.remap=true",
                                    f"parallel.prefetch_after_attention={unset_or_off}",
                                    ])  # fmt: skip
        run = RunModel.create(config, Hardware.preset(build_topology(config.topology)))
        plan, remap = plan_batch(batch_lengths("prolong64k", 4096 * 64, 0), run)
        steps[after] = simulate_plan(plan, run, True, remap)
    assert any(len(item.ranks) > 8 for item in plan.items())  # a ring crosses nodes
    late = steps[True].forward
    tasks = late.graph.tasks
    attention_end = max(late.end[i] for i, t in enumerate(tasks) if t.name.startswith("attention"))
    gathers = [i for i, t in enumerate(tasks) if t.name == "weights gather/scatter"]
    assert gathers and min(late.start[i] for i in gathers) >= attention_end
    assert steps[True].forward_layer_seconds < 0.99 * steps[False].forward_layer_seconds
    # the baselines run as their own systems do: FSDP2's own prefetch
    from ray_zep.sim.compare import variant_config

    default = load_config(None, [])
    assert variant_config(default, "zeppelin", 5120).parallel.prefetch_after_attention is None
    for other in ("te_cp", "megatron_dynamic_cp", "bytescale_hdp"):
        assert variant_config(default, other, 5120).parallel.prefetch_after_attention is False
        assert variant_config(default, other, 5120).parallel.prefetch_depth == 1
    assert variant_config(default, "zeppelin", 5120).parallel.prefetch_depth is None
