"""The exchange kinds table: every kind described once, and the engine, the schedule, the
plan statistics, routing, traffic and the simulator each doing what the kind says."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from ray_zep.attention import engine
from ray_zep.attention.schedule import expected_ops
from ray_zep.config import load_config
from ray_zep.costmodel import ComputeRates, CostModel, kv_bytes_per_token
from ray_zep.errors import PlacementError
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import Placement
from ray_zep.partition import make_plan
from ray_zep.partition import plan as plan_module
from ray_zep.partition.exchange import EXCHANGES, Exchange, Play
from ray_zep.partition.plan import AttentionPlan, QueueItem, SeqPlacement, Zone, even_bounds
from ray_zep.partition.stats import collective_bytes, kept_kv_tokens, plan_stats
from ray_zep.partition.work import WorkModel
from ray_zep.routing.link_bytes import ring_link_bytes_by_payload
from ray_zep.routing.routes import Payload, Phase, RoutingPlan
from ray_zep.sim import program
from ray_zep.sim.events import Lane
from ray_zep.sim.graph_builder import LayerSetup
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.program import attention_graph
from ray_zep.sim.ring_form import ARRAY_RING, array_ring
from ray_zep.sim.step import RunModel, simulate_plan
from ray_zep.topology import LinkKind, build_topology
from ray_zep.traffic import collective_traffic, kv_row_bytes, ring_traffic
from tests.helpers.attention import reference, ring_rank, with_exchange
from tests.helpers.procs import run_ranks

SHAPE = build_shape(load_config(None, ["model.n_heads=8", "model.n_kv_heads=2"]).model)
RATES = ComputeRates(1e9, 0.8e9, 2e9, call_overhead_s=1e-6, source="test")
GLOBAL_RING = {
    Exchange.RING: Placement.TE_CP,
    Exchange.RING_KEPT: Placement.TE_CP,
    Exchange.ALL_GATHER: Placement.LLAMA_CP,
}
"""The placement whose planner puts the batch on one ring of all ranks (each kind set on
its groups, `with_exchange`)."""
LENGTHS = [1, 3, 7, 100, 41, 2]
CARRIED_BY_HAND = {
    Exchange.RING: lambda held, p: sum(held[(p - s) % len(held)] for s in range(len(held) - 1)),
    Exchange.RING_KEPT: lambda held, p: sum(
        held[(p - s) % len(held)] for s in range(len(held) - 1)
    ),
    Exchange.ALL_GATHER: lambda held, p: (len(held) - 1) * max(held),
}
"""Rows member p of a ring sends forward, from the positions' tokens `held`: every
position but its successor's (R - 1 steps; zigzag sends whole blocks), or R - 1 padded
blocks of the all-gather."""


def _topology(nodes: int, gpus: int):
    return build_topology(
        load_config(None, [f"topology.nodes={nodes}", f"topology.gpus_per_node={gpus}"]).topology
    )


def _global_ring(exchange: Exchange, nodes: int = 2, gpus: int = 2):
    """The batch on one ring of all ranks exchanging by `exchange`, and its one item."""
    plan = make_plan(GLOBAL_RING[exchange], LENGTHS, _topology(nodes, gpus), 64, SHAPE)
    plan = with_exchange(plan, exchange)
    (item,) = plan.items()
    assert item.exchange is exchange
    return plan, item


@pytest.mark.unit
def test_every_exchange_has_one_kind_and_every_play_a_path() -> None:
    assert set(EXCHANGES) == set(Exchange) == set(GLOBAL_RING) == set(CARRIED_BY_HAND)
    assert all(kind.exchange is exchange for exchange, kind in EXCHANGES.items())
    assert plan_module.Exchange is Exchange  # still importable from the plan
    assert set(engine._FORWARD) == set(engine._BACKWARD) == set(program.PLAYS) == set(Play)


@pytest.mark.unit
@pytest.mark.parametrize("exchange", list(Exchange))
def test_a_member_sends_the_rows_its_kind_carries(exchange: Exchange) -> None:
    plan, item = _global_ring(exchange)
    kind, ring = item.exchange_kind, item.ring_size
    held = plan.position_tokens(item)
    stats = plan_stats(plan, SHAPE)
    sent = sum(stats.sent_bytes.values())
    collective = sum(stats.collective_bytes.values())
    rotated = plan.carried(item).sent()
    for position, rank in enumerate(item.ranks):
        rows = kind.carried_tokens(rotated[position], max(held), ring)
        assert rows == CARRIED_BY_HAND[exchange](held, position) > 0
        assert sent[rank] == rows * kv_bytes_per_token(SHAPE), f"rank {rank}"
        assert collective[rank] == (sent[rank] if kind.collective else 0), f"rank {rank}"
    moved = collective_traffic(plan, SHAPE)
    assert (moved.intra_node + moved.inter_node > 0) == kind.collective
    rotated = ring_traffic(plan, SHAPE, routed=False)
    assert (rotated.intra_node + rotated.inter_node > 0) == kind.rotates


@pytest.mark.unit
def test_rotating_rows_are_the_ring_transfers_forward() -> None:
    """The rows of `carried_tokens` are what routing lists hop by hop, step by step."""
    plan, item = _global_ring(Exchange.RING)
    ring, held = item.ring_size, plan.position_tokens(item)
    listed: Counter = Counter()
    for t in RoutingPlan.build(plan, routed=False, all_hops=True).forward:
        listed[t.route.src] += t.route.rows
    rotated = plan.carried(item).sent()
    for position, rank in enumerate(item.ranks):
        assert listed[rank] == item.exchange_kind.carried_tokens(rotated[position], max(held), ring)
        assert listed[rank] == CARRIED_BY_HAND[Exchange.RING](held, position)


@pytest.mark.unit
@pytest.mark.parametrize("exchange", list(Exchange))
def test_layer_seconds_are_the_kinds_formula(exchange: Exchange) -> None:
    """The plan statistics (on arrays) time a layer as the kind's scalar formula does."""
    plan, item = _global_ring(exchange)
    kind = item.exchange_kind
    stats = plan_stats(plan, SHAPE)
    cost = CostModel.create(SHAPE, plan.topology)
    compute = cost.attention_seconds(float(stats.attention_flops.max()))
    step_bytes = max(plan.position_tokens(item)) * kv_bytes_per_token(SHAPE)
    step = cost.transfer_seconds(
        step_bytes, LinkKind.INTER_NODE, one_sender_per_nic=kind.one_sender_per_nic
    )
    expected = kind.layer_seconds(compute, step, item.ring_size)
    assert stats.seconds == pytest.approx(np.full(plan.world, expected), rel=1e-12)
    assert compute < expected


@pytest.mark.unit
def test_rotating_overlaps_what_gathering_waits_for() -> None:
    ring, gather = EXCHANGES[Exchange.RING], EXCHANGES[Exchange.ALL_GATHER]
    assert ring.layer_seconds(8.0, 1.0, 4) == 2.0 + 3 * 2.0
    assert gather.layer_seconds(8.0, 1.0, 4) == 8.0 + 3 * 1.0
    assert ring.layer_seconds(8.0, 1.0, 4, heads=0.5) == 8.5


@pytest.mark.unit
@pytest.mark.parametrize("exchange", list(Exchange))
def test_schedule_and_simulator_issue_the_kinds_calls(exchange: Exchange) -> None:
    """`expected_ops` tallies the kind's calls, and the simulated layer has as many
    messages (a message is one member's send and another's receive) or collectives."""
    plan, item = _global_ring(exchange, 1, 4)
    ring = item.ring_size
    calls = item.exchange_kind.calls_per_layer(ring)
    assert all(expected_ops(plan, rank) == calls for rank in range(plan.world))
    cost = CostModel(SHAPE, plan.topology, RATES.attention_forward)
    routing = RoutingPlan.build(plan, routed=False, all_hops=True)
    setup = LayerSetup(plan, SHAPE, cost, RATES, routing)
    tasks = [t for phase in Phase for t in attention_graph(setup, phase).tasks]
    names = Counter(t.name for t in tasks)
    assert 2 * (names["K/V"] + names["dK/dV"]) == ring * calls["p2p"]

    def collectives(name: str) -> int:  # a collective's parts, one a link, start together
        return len({t.deps for t in tasks if t.name == name})

    assert collectives("K/V all-gather") == calls["all_gather"]
    assert collectives("dK/dV reduce-scatter") == calls["reduce_scatter"]


@pytest.mark.unit
def test_one_position_exchanges_nothing() -> None:
    for kind in EXCHANGES.values():
        assert kind.calls_per_layer(1) == Counter()
        assert kind.play_for(1) is Play.ROTATE
        assert kind.play_for(2) is kind.play


@pytest.mark.unit
@pytest.mark.parametrize("exchange", list(Exchange))
def test_routing_and_array_rings_take_only_their_kinds(exchange: Exchange) -> None:
    plan, item = _global_ring(exchange)
    kind = item.exchange_kind
    assert bool(RoutingPlan.build(plan, routed=True).forward) == kind.routable
    big = _topology(1, ARRAY_RING)
    ranks = tuple(range(ARRAY_RING))
    assert array_ring(QueueItem(Zone.INTRA_NODE, ranks, 1, exchange, (0,)), big, False) == (
        kind.plays_on_arrays
    )


@pytest.mark.unit
@pytest.mark.parametrize("exchange", list(Exchange))
def test_a_world_spanning_kind_refuses_a_smaller_group(exchange: Exchange) -> None:
    placement = SeqPlacement(0, 8, (0, 1), even_bounds(8, 2), exchange=exchange)
    plan = AttentionPlan(Placement.ZEPPELIN, _topology(1, 4), 64, (placement,))
    if EXCHANGES[exchange].spans_world:
        with pytest.raises(PlacementError, match="span all 4 ranks"):
            plan.validate()
    else:
        plan.validate()


def _ring_all(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [ring_rank(rank, world, case) for case in cases]


@pytest.mark.dist
def test_engine_issues_the_kinds_calls() -> None:
    """What the engine tallies on each rank for a layer is its kind's `calls_per_layer`."""
    cases = [
        dict(
            strategy=GLOBAL_RING[exchange].value,
            exchange=exchange.value,
            nodes=1,
            gpus=2,
            heads=8,
            kv_heads=2,
            dim=4,
            lengths=[1, 7, 3, 12],
            capacity=16,
        )
        for exchange in Exchange
    ]
    results = run_ranks(_ring_all, 2, cases)
    for index, exchange in enumerate(Exchange):
        calls = dict(EXCHANGES[exchange].calls_per_layer(2))
        assert calls
        for rank, per_rank in enumerate(results):
            assert per_rank[index]["ops"] == calls, f"{exchange.value} rank {rank}"


@pytest.mark.unit
def test_a_kept_ring_sends_its_kv_once_and_keeps_the_other_positions() -> None:
    """`ring_kept`: the backward lists dK/dV transfers only, its K/V bytes are one round
    where the ring's are two (dK/dV the same), every member keeps the rows of every other
    position, and the work model's backward hop drops the K/V share (the budget allowing)."""
    plan, _ = _global_ring(Exchange.RING)
    kept, item = _global_ring(Exchange.RING_KEPT)
    for p, backward_kv in ((plan, True), (kept, False)):
        routing = RoutingPlan.build(p, routed=False, all_hops=True)
        payloads = {t.payload for t in routing.backward}
        assert (Payload.KV in payloads) is backward_kv and Payload.DKV in payloads
        assert {t.payload for t in routing.forward} == {Payload.KV}
    rows = kv_row_bytes(SHAPE, 2)
    rotated, once = (ring_link_bytes_by_payload(p, False, rows) for p in (plan, kept))
    assert once[Payload.KV][0] * 2 == rotated[Payload.KV][0] > 0
    # dK/dV: every position's accumulator makes R hops, R - 1 where kept (own block last)
    ring = item.ring_size
    assert _dkv_rows(kept) * ring == _dkv_rows(plan) * (ring - 1) > 0
    dkv_bytes = [b[Payload.DKV][0] + int(b[Payload.DKV][1].sum()) for b in (rotated, once)]
    assert dkv_bytes[1] * ring == dkv_bytes[0] * (ring - 1) > 0
    held = np.asarray(kept.position_tokens(item))
    assert kept_kv_tokens(kept)[list(item.ranks)].tolist() == (held.sum() - held).tolist()
    assert not kept_kv_tokens(plan).any()

    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=4",
                                "model.preset=7b"])  # fmt: skip
    shape, topology = build_shape(config.model), build_topology(config.topology)
    lengths, degree = np.asarray([131072]), np.asarray([32])  # across 4 nodes' NICs
    member = [WorkModel.create(shape, topology, keep_kv_gb=gb).alone_ring_seconds(lengths, degree)
              for gb in (0.0, 100.0)]  # fmt: skip
    assert member[1][0] < 0.9 * member[0][0]  # bound by its transfers: fewer bytes, less time
    assert not WorkModel.create(shape, topology, keep_kv_gb=1.0).keeps_kv(131072)


def _dkv_rows(plan: AttentionPlan) -> int:
    """The dK/dV rows the backward's transfers list, every hop (`RoutingPlan`)."""
    backward = RoutingPlan.build(plan, routed=False, all_hops=True).backward
    return sum(t.route.rows for t in backward if t.payload is Payload.DKV)


@pytest.mark.unit
def test_usp_sums_are_worked_out_once_per_shape_and_read_alike() -> None:
    """A step's plan statistics and its collective bytes both sum the Ulysses items: the
    second reads the first's sums (kept on the plan, by model shape), which equal sums
    worked out anew on a fresh plan, and another shape gets its own."""
    topo, lengths = _topology(2, 4), [300, 120, 45, 7]
    plan = make_plan(Placement.USP, lengths, topo, 256, SHAPE)
    assert any(item.ulysses > 1 for item in plan.items())
    first = plan_stats(plan, SHAPE)
    cached = collective_bytes(plan, SHAPE)
    anew = collective_bytes(make_plan(Placement.USP, lengths, topo, 256, SHAPE), SHAPE)
    for kind in LinkKind:
        assert np.array_equal(cached[kind], first.collective_bytes[kind])
        assert np.array_equal(cached[kind], anew[kind])
    assert sum(cached[kind].sum() for kind in LinkKind) > 0
    fresh = plan_stats(make_plan(Placement.USP, lengths, topo, 256, SHAPE), SHAPE)
    assert np.array_equal(plan_stats(plan, SHAPE).seconds, fresh.seconds)
    wider = build_shape(load_config(None, ["model.n_heads=8", "model.n_kv_heads=8"]).model)
    more = collective_bytes(plan, wider)
    assert sum(more[k].sum() for k in LinkKind) > sum(cached[k].sum() for k in LinkKind)


@pytest.mark.unit
def test_a_kept_owner_ring_computes_its_own_block_last() -> None:
    """Sending each step's dK/dV to its owner (`parallel.dkv_wire=owner`), a ring that kept
    the forward's K/V computes its own block last, so that the last dK/dV message is in
    flight during that step rather than after the ring; a ring rotating its K/V again
    computes its own block first. In the simulator no kept member's backward then ends on
    a dK/dV message: the layer is shorter than in step order, by up to one hop."""
    kept, ring = (EXCHANGES[e] for e in (Exchange.RING_KEPT, Exchange.RING))
    assert kept.backward_order(4) == [1, 2, 3, 0] and ring.backward_order(4) == [
        0,
        1,
        2,
        3,
    ]
    assert kept.backward_order(1) == [0]
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=2",
                                "model.preset=7b", "train.tokens_per_rank=8192",
                                "parallel.sequence=zeppelin"])  # fmt: skip
    topology = build_topology(config.topology)
    n = 65536
    usp = SeqPlacement(0, n, tuple(range(16)), even_bounds(n, 2), ulysses=8)
    plan = with_exchange(AttentionPlan(Placement.ZEPPELIN, topology, 8192, (usp,)),
                         Exchange.RING_KEPT)  # fmt: skip
    (item,) = plan.items()
    assert item.owner_dkv and item.exchange_kind.keeps_kv
    run = RunModel.create(config, Hardware.preset(topology))
    ends = {}
    with pytest.MonkeyPatch.context() as patch:
        for name in ("own last", "in step order"):
            if name == "in step order":
                patch.setattr(type(item.exchange_kind), "backward_order",
                              lambda self, steps: list(range(steps)))  # fmt: skip
            step = simulate_plan(plan, run, False, None)
            timeline = step.backward
            last = {}
            for rank in item.ranks:
                spans = [*timeline.intervals(rank, Lane.COMPUTE),
                         *timeline.intervals(rank, Lane.INTER_NODE)]  # fmt: skip
                last[rank] = max(spans)[2] if spans else ""
            ends[name] = (step.backward_layer_seconds, last)
    assert ends["own last"][0] < ends["in step order"][0]
    assert not any("dK/dV" in what for what in ends["own last"][1].values())


@pytest.mark.unit
def test_a_kept_accumulator_ring_computes_its_own_block_last() -> None:
    """Passing dK/dV accumulators round a ring across two nodes (no owner wire there), a
    ring that kept the forward's K/V computes its own block last: each accumulator starts
    on the member after its owner, so a member sends R - 1 of them, not R, and the last
    one reaches its owner during that member's own block."""
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=2",
                                "model.preset=7b", "train.tokens_per_rank=8192",
                                "parallel.sequence=zeppelin"])  # fmt: skip
    topology = build_topology(config.topology)
    n, ring = 65536, 16
    placement = SeqPlacement(0, n, tuple(range(ring)), even_bounds(n, ring))
    plan = with_exchange(AttentionPlan(Placement.ZEPPELIN, topology, 8192, (placement,)),
                         Exchange.RING_KEPT)  # fmt: skip
    (item,) = plan.items()
    assert not item.owner_dkv and item.exchange_kind.keeps_kv
    step = simulate_plan(plan, RunModel.create(config, Hardware.preset(topology)), False, None)
    tasks = step.backward.graph.tasks
    sent = Counter(t.rank for t in tasks if t.name == "dK/dV")
    assert sent == dict.fromkeys(item.ranks, ring - 1)
    for rank in item.ranks:
        steps = [name for _, _, name in sorted(step.backward.intervals(rank, Lane.COMPUTE))
                 if name.startswith("attention step")]  # fmt: skip
        assert steps == [f"attention step {s}" for s in [*range(1, ring), 0]], rank


@pytest.mark.dist
def test_a_kept_ring_still_equals_one_device() -> None:
    """Own block last (`ExchangeKind.backward_order`) on 2x2, fp32, in every ring that kept
    the forward's K/V: sending dK/dV to their owners, zeppelin's rings inside a node and
    usp's Ulysses groups across nodes; passing accumulators round the ring, te_cp's ring
    of the four ranks (direct and routed: the relays carry no accumulator off a member's
    own block) and zeppelin's rings. Each gives one device's outputs and gradients
    (rel 1e-5), and each rank sends the messages its schedule counts."""
    lengths = [1, 7, 3, 3, 2, 61, 1, 2, 1, 3, 33]
    capacity = -(-sum(lengths) // 4) + 4
    shared = dict(nodes=2, gpus=2, heads=8, kv_heads=2, dim=4, lengths=lengths,
                  capacity=capacity, exchange=Exchange.RING_KEPT.value)  # fmt: skip
    wires = [("zeppelin", False, True), ("usp", False, True), ("te_cp", False, False),
             ("te_cp", True, False), ("zeppelin", False, False)]  # fmt: skip
    cases = [{**shared, "strategy": strategy, "routing": routing, "dkv_to_owner": owner}
             for strategy, routing, owner in wires]  # fmt: skip
    for case in cases:
        plan = with_exchange(make_plan(Placement(case["strategy"]), lengths, _topology(2, 2),
                                       case["capacity"], SHAPE), Exchange.RING_KEPT)  # fmt: skip
        owner = case["dkv_to_owner"]
        rings = [i for i in plan.items() if i.ring_size > 1 and (i.owner_dkv or not owner)]
        assert rings, case["strategy"]
    results = run_ranks(_ring_all, 4, cases)
    q, k, v, _, out = reference(lengths, 8, 2, 4, 0)
    for index, case in enumerate(cases):
        for rank, per_rank in enumerate(results):
            got = per_rank[index]
            rows = torch.as_tensor(got["rows"])
            n = len(rows)
            expected = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
            for name, ref in expected.items():
                value = got[name]
                scale = float(ref.abs().max())
                error = float((value[:n] - ref[rows]).abs().max()) if n else 0.0
                assert error <= 1e-5 * scale, f"{case['strategy']} rank {rank} {name}: {error:.2e}"
            assert got["ops"] == got["expected_ops"], f"{case['strategy']} rank {rank}"
