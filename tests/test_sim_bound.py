"""The step bound: no plan beats it, and it counts the exchange where that rules.

Every variant `ray-zep simulate` knows (every planner with its layers, the baselines'
own systems), plans of whole sequences on random ranks, and batches whose bound is set
by the compute and by the K/V exchange are simulated; each step must be at least the
bound. A relative slack of 1e-9 covers float summation order only.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ray_zep.config import load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.errors import ZepError
from ray_zep.partition import plan_from_bins, work
from ray_zep.partition.plan import AttentionPlan, SeqPlacement, bounds_for_counts
from ray_zep.sim.bound import over_bound, step_bound
from ray_zep.sim.compare import VARIANTS, simulate_strategies
from ray_zep.sim.events import Lane
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.ideal import ideal_step_seconds
from ray_zep.sim.request import SimulateRequest, batches_of, request_hardware, run_simulate
from ray_zep.sim.step import RunModel, plan_batch, simulate_plan, weights_of
from ray_zep.topology import build_topology

pytestmark = pytest.mark.unit

L = 4096
SLOW_NICS = ["topology.nic_gbits_per_s=10"]
"""Inter-node links slow enough that a long sequence's K/V outweighs the compute."""


@pytest.fixture
def two_node_positions(monkeypatch):
    """USP positions of at most two nodes (`ray_zep.partition.work.WIDE_SPAN`), for the
    planners and the bound alike: the tests that use it set their bound by the K/V one
    node imports for a sequence of four nodes' capacity on four nodes, which positions
    of four nodes (7B's 32 heads split over 32 GPUs) would hold whole, importing none."""
    monkeypatch.setattr(work, "WIDE_SPAN", 2)


def _config(nodes: int, extra: list[str]):
    overrides = ["topology.preset=cluster_a", f"topology.nodes={nodes}", "model.preset=7b",
                 f"train.tokens_per_rank={L}", "parallel.weights=fsdp", *extra]  # fmt: skip
    return load_config(None, overrides)


CASES = [
    (2, "github", []),
    (4, "chat", []),
    (4, "arxiv", SLOW_NICS),
    (2, "chat", SLOW_NICS),
]


@pytest.mark.parametrize("nodes,distribution,extra", CASES, ids=lambda v: str(v))
def test_no_variant_beats_the_bound(nodes: int, distribution: str, extra: list[str]) -> None:
    config = _config(nodes, extra)
    hardware = Hardware.preset(build_topology(config.topology))
    world = hardware.devices
    batches = [batch_lengths(distribution, L * world * 9 // 10, seed) for seed in range(2)]
    results = simulate_strategies(config, hardware, batches, tuple(VARIANTS), L)
    run = RunModel.create(config, hardware)
    bounds = [step_bound(lengths, run).seconds for lengths in batches]
    simulated = 0
    for name, result in results.items():
        for step, bound in zip(result.steps, bounds, strict=True):
            assert step.step_seconds >= bound * (1 - 1e-9), f"{name}: {step.step_seconds} < {bound}"
            simulated += 1
    assert simulated >= 2 * (len(VARIANTS) - 2), "most variants place these batches"


def test_no_variant_beats_the_bound_where_kv_and_fsdp_share_the_nics(two_node_positions) -> None:
    """A sequence of four nodes' capacity on 40 Gbit/s NICs (beside a short one): the K/V
    the tail node imports and FSDP's per-block collectives together set the bound."""
    config = _config(4, ["topology.nic_gbits_per_s=40"])
    hardware = Hardware.preset(build_topology(config.topology))
    batches = [np.asarray([32 * L]), np.asarray([31 * L, L])]
    run = RunModel.create(config, hardware)
    bounds = [step_bound(lengths, run) for lengths in batches]
    for bound in bounds:
        assert bound.shared_nics_s > max(bound.compute_s, bound.exchange_s, bound.weights_s)
        assert bound.seconds == pytest.approx(sum(bound.phases) + bound.fixed_s, rel=1e-12)
        assert bound.seconds >= bound.shared_nics_s + bound.fixed_s
    results = simulate_strategies(config, hardware, batches, tuple(VARIANTS), L)
    simulated = 0
    for name, result in results.items():
        for step, bound in zip(result.steps, bounds, strict=True):
            assert step.step_seconds >= bound.seconds * (1 - 1e-9), (name, step.step_seconds)
            simulated += 1
    assert simulated >= len(VARIANTS), "most variants place these batches"
    # hsdp: its replicas' all-reduce crosses the NICs in the backward, beside the dK/dV
    hsdp = _config(4, ["topology.nic_gbits_per_s=40", "parallel.weights=hsdp"])
    run = RunModel.create(hsdp, hardware)
    bounds = [step_bound(lengths, run) for lengths in batches]
    assert all(b.shared_nics_s > b.exchange_s > 0 for b in bounds)
    results = simulate_strategies(hsdp, hardware, batches, tuple(VARIANTS), L)
    for name, result in results.items():
        for step, bound in zip(result.steps, bounds, strict=True):
            assert step.step_seconds >= bound.seconds * (1 - 1e-9), (name, "hsdp")


def test_the_forward_and_the_backward_are_bounded_each_by_its_own_parts(two_node_positions) -> None:
    """One sequence of four nodes' capacity on 50 Gbit/s NICs: the forward is set by the
    tail node's NICs (its K/V and FSDP's gathers), the backward by the compute. The two
    phases add, so the bound exceeds the larger of the whole step's compute and its NIC
    time (a forward bound by the NICs cannot borrow the backward's compute to hide them),
    and still no variant beats it."""
    config = _config(4, ["topology.nic_gbits_per_s=50"])
    hardware = Hardware.preset(build_topology(config.topology))
    run = RunModel.create(config, hardware)
    batches = [np.asarray([4 * 8 * L])]
    bound = step_bound(batches[0], run)
    whole_step = max(bound.compute_s, bound.exchange_s, bound.weights_s, bound.shared_nics_s)
    assert bound.seconds == pytest.approx(sum(bound.phases) + bound.fixed_s, rel=1e-12)
    assert bound.seconds > 1.05 * (whole_step + bound.fixed_s)
    nics = "K/V and weight collectives on one node's NICs"
    assert bound.setting == (nics, "compute")
    assert bound.largest == f"forward: {nics}, backward: compute"
    results = simulate_strategies(config, hardware, batches, tuple(VARIANTS), L)
    simulated = 0
    for name, result in results.items():
        for step in result.steps:
            assert step.step_seconds >= bound.seconds * (1 - 1e-9), (name, step.step_seconds)
            simulated += 1
    assert simulated >= len(VARIANTS) // 2, "most variants place this batch"


def test_random_whole_sequence_plans_do_not_beat_the_bound() -> None:
    config = _config(2, [])
    hardware = Hardware.preset(build_topology(config.topology))
    run = RunModel.create(config, hardware)
    rng = np.random.default_rng(0)
    world = hardware.devices
    played = 0
    for seed in range(4):
        lengths = rng.integers(1, L // 4, size=world * 2)
        bins: list[list[int]] = [[] for _ in range(world)]
        for seq in range(lengths.size):
            bins[int(rng.integers(world))].append(seq)
        if max(int(lengths[b].sum()) for b in bins) > L:
            continue  # the bound is for plans holding at most L tokens a rank
        try:
            plan = plan_from_bins(lengths, bins, hardware.topology, L, config.parallel.sequence)
        except ZepError:
            continue
        step = simulate_plan(plan, run).step_seconds
        assert step >= step_bound(lengths, run).seconds * (1 - 1e-9), seed
        played += 1
    assert played >= 3, "most random plans hold at most L tokens a rank"


def test_the_bound_is_near_the_ideal_where_compute_rules_and_above_where_the_exchange_does(
    two_node_positions,
) -> None:
    short = np.full(64, L // 2)
    fast = _config(2, [])
    run = RunModel.create(fast, Hardware.preset(build_topology(fast.topology)))
    bound = step_bound(short, run)
    assert bound.exchange_s == 0.0 and bound.limit == "none"
    # the ideal less its kernel calls' fixed costs, plus FSDP2's first gathers and last
    # reduce-scatters and their gathers slowing the linear modules: a few per mille below
    # the ideal on 7B
    assert bound.contention_s > 0.01 * bound.seconds
    ideal = ideal_step_seconds(short, run) + weights_of(run).exposed + bound.contention_s
    assert 0.99 * ideal <= bound.seconds <= ideal
    # one sequence of four nodes' capacity on slow NICs: the tail node imports 3/4 of its
    # K/V, or, on positions of two nodes each attending with half of the heads, half that
    # (its all-to-all brings it the hidden rows of its other node's 8 L tokens, half a
    # K/V's bytes each: as many again)
    slow = _config(4, SLOW_NICS)
    run = RunModel.create(slow, Hardware.preset(build_topology(slow.topology)))
    long = np.asarray([4 * 8 * L])
    bound = step_bound(long, run)
    assert bound.exchange_bound and bound.seconds > 1.5 * ideal_step_seconds(long, run)
    topology = run.hardware.topology
    node_in = topology.nics_per_node * topology.nic_bandwidth
    token_bytes = 2 * run.shape.n_kv_heads * run.shape.head_dim * run.element_bytes
    expected = 2 * run.shape.n_layers * token_bytes * (3 * 8 * L / 2) / node_in
    assert bound.limit == "node" and bound.exchange_s == pytest.approx(expected, rel=1e-12)


def test_the_bound_counts_the_collectives_slowing_the_linear_modules_as_the_simulator_does() -> (
    None
):
    """Where every rank holds L tokens, the least the per-block FSDP collectives slow the
    linear modules by (the bound's `contention_s`) is what the simulator charges them;
    without contention the bound counts none."""
    config = _config(2, [])
    hardware = Hardware.preset(build_topology(config.topology))
    run = RunModel.create(config, hardware)
    calm = dataclasses.replace(
        run, hardware=dataclasses.replace(hardware, rates=dataclasses.replace(
            hardware.rates, contention=1.0)))  # fmt: skip
    full = np.full(2 * hardware.devices, L // 2)  # two a rank, L tokens on every rank
    bound, calm_bound = step_bound(full, run), step_bound(full, calm)
    assert calm_bound.contention_s == 0.0 and bound.contention_s > 0.0
    assert bound.compute_s - calm_bound.compute_s == pytest.approx(bound.contention_s, rel=1e-12)
    plan, _ = plan_batch(full, run)
    assert set(plan.rank_tokens()) == {L}

    def linear_seconds(step) -> float:
        tasks = [t for timeline in (step.forward, step.backward) for t in timeline.graph.tasks]
        names = ("QKV projection", "output projection + MLP")
        return sum(t.duration for t in tasks if t.name in names) * run.shape.n_layers

    slowed = linear_seconds(simulate_plan(plan, run)) - linear_seconds(simulate_plan(plan, calm))
    assert slowed / hardware.devices == pytest.approx(bound.contention_s, rel=1e-9)


def test_simulate_reports_step_over_bound_and_where_the_rest_goes() -> None:
    config = _config(2, [])
    request = SimulateRequest("zeppelin,te_cp", batches=1, distribution="chat", tokens=16 * L)
    result = run_simulate(config, request)
    for name, strategy in result.results.items():
        assert result.over_bound(strategy) >= 1.0 - 1e-9, name
        parts = result.beyond_bound(strategy)
        step, bound = strategy.steps[0].step_seconds, result.bounds[0].seconds
        assert sum(parts.values()) == pytest.approx(step - bound, rel=1e-9, abs=1e-12), name
        idle = (parts["exposed transfers"], parts["waits"])
        assert min(parts["imbalance"], *idle) >= 0, (name, parts)
    record = result.record()["strategies"]["zeppelin"]
    assert record["step_over_bound"] == result.over_bound(result.results["zeppelin"])
    # te_cp rotates every sequence's K/V over all 16 GPUs: its exposed transfers dominate
    te_cp = result.beyond_bound(result.results["te_cp"])
    assert te_cp["exposed transfers"] > max(te_cp["imbalance"], te_cp["split kernels"])


def test_contention_beyond_the_bound_is_its_own_part() -> None:
    """What communication kernels slow the mean rank's compute by, beyond the least the
    bound counts, is its own part: the same plan played without contention has none and
    the same split kernels, and with it the part is the mean rank's slowed compute less
    the bound's share of it."""
    config = _config(2, ["parallel.sequence=zeppelin"])
    hardware = Hardware.preset(build_topology(config.topology))
    run = RunModel.create(config, hardware)
    calm = dataclasses.replace(
        run, hardware=dataclasses.replace(hardware, rates=dataclasses.replace(
            hardware.rates, contention=1.0)))  # fmt: skip
    lengths = np.asarray([7 * L, 3 * L, *([L // 4] * 16)])
    plan, remap = plan_batch(lengths, run)
    parts, steps, bounds = {}, {}, {}
    for name, one in (("slowed", run), ("calm", calm)):
        steps[name] = simulate_plan(plan, one, one.config.parallel.routing, remap)
        bounds[name] = step_bound(lengths, one)
        parts[name] = over_bound(steps[name], bounds[name], run.shape.n_layers)
    assert parts["calm"]["contention"] == 0.0 and parts["slowed"]["contention"] > 0.0
    assert parts["slowed"]["split kernels"] == pytest.approx(parts["calm"]["split kernels"],
                                                              rel=1e-9)  # fmt: skip

    def mean_compute(step) -> float:
        timelines = (step.forward, step.backward)
        busy = [sum(t.busy(r, Lane.COMPUTE) for t in timelines) for r in range(plan.world)]
        return float(np.mean(busy)) * run.shape.n_layers

    slowed = mean_compute(steps["slowed"]) - mean_compute(steps["calm"])
    assert parts["slowed"]["contention"] + bounds["slowed"].contention_s == pytest.approx(
        slowed, rel=1e-9)  # fmt: skip


def test_what_checkpointing_recomputes_is_named_beyond_the_bound() -> None:
    """Under activation checkpointing the step's recomputation is its own part, not left
    in the rest: the same batch without checkpointing has none, and with `full` on every
    block the part is what the step says it recomputes."""
    request = SimulateRequest("zeppelin", batches=1, distribution="chat", tokens=16 * L)
    parts = {}
    for mode in ("none", "full"):
        result = run_simulate(_config(2, [f"train.activation_checkpointing={mode}"]), request)
        strategy = result.results["zeppelin"]
        parts[mode] = result.beyond_bound(strategy)
        assert parts[mode]["recompute"] == strategy.steps[0].recompute_seconds
    assert parts["none"]["recompute"] == 0.0
    assert parts["full"]["recompute"] > 0.05 * result.bounds[0].seconds
    # the rest is what neither run changes: checkpointing moved into its own part
    assert parts["full"]["rest"] == pytest.approx(parts["none"]["rest"], rel=1e-6, abs=1e-9)


def test_no_composition_of_the_demo_beats_its_bound() -> None:
    """The demo's tiny model on many packed sequences: there a kernel call's fixed cost
    and the model's own kernel rates matter, and whole-sequence packing may not beat
    the bound either (every composition `plan --auto` tries)."""
    from ray_zep.sim.auto import auto_plan

    config = load_config("conf/demo.yaml", [])
    hardware, on_gpu = request_hardware(config, None)
    batches, _ = batches_of(config, hardware.topology, SimulateRequest(None, False, 1, "github"))
    result = auto_plan(config, hardware, lambda _: [(b, None) for b in batches], on_gpu)
    ratios = {c.name: c.over_bound for c in result.candidates if c.steps}
    assert len(ratios) > 50
    assert min(ratios.values()) >= 1.0 - 1e-9, min(ratios.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("nodes,ulysses", [(1, 2), (1, 4), (1, 8), (2, 16), (8, 32)])
def test_a_usp_group_does_not_beat_the_bound(nodes: int, ulysses: int) -> None:
    """One sequence of the topology's capacity as a USP group on slow links (1 GB/s inside
    a node, 1 Gbit/s NICs): each GPU attends with H / U of the heads (each node with 1 / s
    of them, on positions of s nodes), so it imports only those heads' K/V and swaps
    its heads' Q/K/V inside the position. The bound counts that: a GPU importing every
    head's K/V of the other 7 L tokens, as it counted before, put it above each of the
    one-node plans' steps (U = 8: 73.9 s against 66.5 s)."""
    slow = ["topology.intra_node_gbytes_per_s=1", "topology.nic_gbits_per_s=1"]
    config = _config(nodes, [*slow, "parallel.weights=replicated", "parallel.sequence=zeppelin"])
    topology = build_topology(config.topology)
    run = RunModel.create(config, Hardware.preset(topology))
    n = topology.world_size * L
    positions = topology.world_size // ulysses
    counts = [n // positions] * positions
    group = SeqPlacement(0, n, tuple(range(topology.world_size)), bounds_for_counts(counts),
                         ulysses=ulysses)  # fmt: skip
    plan = AttentionPlan(config.parallel.sequence, topology, L, (group,))
    step = simulate_plan(plan, run)
    bound = step_bound(np.asarray([n]), run)
    assert step.step_seconds >= bound.seconds * (1 - 1e-9), (step.step_seconds, bound.seconds)
    assert bound.exchange_s > 0, bound
