"""Rings that keep the forward's K/V for the backward (`parallel.ring_kv_keep_gb`): the
budget the planner gets, the rings it keeps, and the memory the model counts for them.
The engine's kept rings train like one process in `tests/test_strategies.py` (zeppelin's
rings keep on the virtual CPU topology) and send what their kind says in
`tests/test_exchange_kinds.py`."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from ray_zep.config import load_config
from ray_zep.costmodel import CostModel
from ray_zep.data.synthetic import batch_lengths
from ray_zep.errors import ConfigError, PlacementError
from ray_zep.model_shapes import build_shape
from ray_zep.options import ActivationCheckpointing, ZonePolicy
from ray_zep.parallel.axes import Placement
from ray_zep.parallel.memory import kept_kv_bytes
from ray_zep.partition import make_plan, work
from ray_zep.partition.balance import balance
from ray_zep.partition.exchange import Exchange
from ray_zep.partition.plan import AttentionPlan
from ray_zep.partition.plan_memory import (
    KEEP_SHARE,
    keep_where_room,
    memory_plan,
    plan_memory,
    planning_parallel,
    rank_memory,
    ring_kv_keep_gb,
    ring_kv_room_mb,
)
from ray_zep.partition.stats import plan_stats
from ray_zep.partition.work import WorkModel
from ray_zep.partition.zeppelin import plan_zeppelin
from ray_zep.run_memory import memory_inputs
from ray_zep.topology import build_topology

pytestmark = pytest.mark.unit

CLUSTER = ["topology.preset=cluster_a", "topology.nodes=4", "model.preset=7b",
           "parallel.sequence=zeppelin", "parallel.weights=fsdp"]  # fmt: skip


def _setup(*overrides: str):
    config = load_config(None, [*CLUSTER, *overrides])
    return config, build_topology(config.topology), build_shape(config.model)


def test_the_budget_is_what_the_gpu_has_room_for_unless_set() -> None:
    config, topology, shape = _setup("train.tokens_per_rank=5120")
    room = ring_kv_keep_gb(config, topology, shape)
    peak = rank_memory(config, topology, shape, 5120, 5120).total / 1e9
    assert room == pytest.approx(0.9 * topology.gpu_memory_bytes / 1e9 - peak) and room > 0
    full, *_ = _setup("train.tokens_per_rank=40960")  # the rank alone fills the GPU
    assert ring_kv_keep_gb(full, topology, shape) == 0.0
    chosen, *_ = _setup("train.tokens_per_rank=5120", "parallel.ring_kv_keep_gb=3.5")
    assert ring_kv_keep_gb(chosen, topology, shape) == 3.5
    cpu = load_config(None, ["topology.nodes=2", "topology.gpus_per_node=2"])
    assert math.isinf(ring_kv_keep_gb(cpu, build_topology(cpu.topology), shape))


def test_the_room_a_token_frees_is_what_it_costs_unless_set() -> None:
    """`parallel.ring_kv_room_mb`: unset, what one token held in a ring costs in the
    memory model; 0 where the budget is set, or on the CPU topology (no limit there);
    what it is set to otherwise; a negative one is refused naming the key."""
    config, topology, shape = _setup("train.tokens_per_rank=5120")
    per_token = (rank_memory(config, topology, shape, 5120, 5120).total
                 - rank_memory(config, topology, shape, 0).total) / 5120 / 1e6  # fmt: skip
    assert ring_kv_room_mb(config, topology, shape) == pytest.approx(per_token) and per_token > 1
    budget, *_ = _setup("train.tokens_per_rank=5120", "parallel.ring_kv_keep_gb=3.5")
    assert ring_kv_room_mb(budget, topology, shape) == 0.0
    chosen, *_ = _setup("train.tokens_per_rank=5120", "parallel.ring_kv_room_mb=2.5")
    assert ring_kv_room_mb(chosen, topology, shape) == 2.5
    cpu = load_config(None, ["topology.nodes=2", "topology.gpus_per_node=2"])
    assert ring_kv_room_mb(cpu, build_topology(cpu.topology), shape) == 0.0
    with pytest.raises(ConfigError, match=r"parallel\.ring_kv_room_mb"):
        _setup("parallel.ring_kv_room_mb=-1")


def test_a_ring_keeps_its_kv_only_within_the_budget_and_the_memory_counts_them() -> None:
    config, topology, shape = _setup("train.tokens_per_rank=5120")
    cost = CostModel.create(shape, topology)
    lengths = np.asarray([98304, *[1024] * 40])  # one sequence across nodes, short ones
    kinds = {}
    for gb in (0.0, 0.5, 40.0):
        plan = plan_zeppelin(lengths, topology, 5120, cost, ZonePolicy.WORK, keep_kv_gb=gb)
        (ring,) = [p for p in plan.placements if len(p.ranks) > 1]
        kinds[gb] = ring.exchange
        stats = plan_stats(plan, shape)
        positions = np.asarray([ring.position_tokens(r) for r in range(ring.ring_size)])
        kept = np.repeat(positions.sum() - positions, ring.ulysses) / ring.ulysses
        expected = kept if ring.exchange is Exchange.RING_KEPT else np.zeros(len(ring.ranks))
        assert stats.kept_kv_tokens[list(ring.ranks)] == pytest.approx(expected)
        fullest = int(np.argmax(stats.kept_kv_tokens))
        counted = plan_memory(config, topology, stats, shape).ranks[fullest].total
        unkept = dataclasses.replace(stats, kept_kv_tokens=np.zeros(topology.world_size))
        plain = plan_memory(config, topology, unkept, shape).ranks[fullest].total
        if ring.exchange is Exchange.RING_KEPT:
            assert counted - plain == pytest.approx(
                2 * shape.n_kv_heads * shape.head_dim * 2 * shape.n_layers
                * stats.kept_kv_tokens[fullest]
            )  # fmt: skip
            assert (counted - plain) / 1e9 <= gb
    assert kinds == {0.0: Exchange.RING, 0.5: Exchange.RING, 40.0: Exchange.RING_KEPT}


def test_full_checkpointing_holds_one_layers_kept_kv() -> None:
    config, topology, shape = _setup("train.activation_checkpointing=full")
    inputs = memory_inputs(config, topology, 1000, kept_kv_tokens=5000.0)
    assert inputs.checkpointing is ActivationCheckpointing.FULL
    one_layer = 2 * shape.n_kv_heads * shape.head_dim * 5000 * inputs.compute_bytes
    assert kept_kv_bytes(shape, inputs) == one_layer
    none, *_ = _setup()
    every = memory_inputs(none, topology, 1000, kept_kv_tokens=5000.0)
    assert kept_kv_bytes(shape, every) == one_layer * shape.n_layers


@pytest.fixture
def one_node_positions(monkeypatch):
    """USP positions of one node at most (`ray_zep.partition.work.WIDE_SPAN`): 13B's
    positions of five nodes keep a fifth of a long document's K/V per member, within a
    full rank's budget, which the tests that use this need their groups to exceed."""
    monkeypatch.setattr(work, "WIDE_SPAN", 1)


def test_a_ring_of_members_with_room_keeps_where_a_full_rank_would_not(one_node_positions) -> None:
    """13B at L = 6,656 on 80 GB: a full rank leaves 8.5 GB, too little for a long
    sequence's USP group of one-node positions to keep its K/V; its members hold far
    fewer tokens, and `keep_where_room` keeps it within the GPU's memory (here after a
    planner held to the budget alone; the resolved planner keeps it itself). A set budget
    is kept to."""
    config, topology, shape = _setup("topology.nodes=16", "model.preset=13b",
                                     "train.tokens_per_rank=6656")  # fmt: skip
    lengths = np.asarray([200000, *[1024] * 200])
    parallel = dataclasses.replace(planning_parallel(config, topology, shape), ring_kv_room_mb=0)
    alone = make_plan(Placement.ZEPPELIN, lengths, topology, 6656, shape, parallel)
    roomy = keep_where_room(alone, config, topology, shape)
    assert alone.placement(0).exchange is Exchange.RING and len(alone.placement(0).ranks) > 8
    planned = memory_plan(Placement.ZEPPELIN, lengths, config, topology, shape)
    assert planned.placement(0).exchange is Exchange.RING_KEPT
    assert roomy.placement(0).exchange is Exchange.RING_KEPT
    assert [p.ranks for p in roomy.placements] == [p.ranks for p in alone.placements]
    # the kept plan carries the planner's queue items and token counts over: as if built anew
    anew = AttentionPlan(roomy.planner, topology, 6656, roomy.placements)
    assert roomy._items is not None and roomy.items() == anew.items()
    assert (roomy.rank_tokens() == anew.rank_tokens()).all()
    assert [roomy.position_tokens(i) for i in roomy.items()] == [
        anew.position_tokens(i) for i in anew.items()
    ]
    memory = plan_memory(config, topology, plan_stats(roomy, shape), shape)
    fullest = memory.ranks[memory.fullest].total
    assert fullest <= KEEP_SHARE * topology.gpu_memory_bytes * 1.01, fullest / 1e9
    capped, *_ = _setup("topology.nodes=16", "model.preset=13b", "train.tokens_per_rank=6656",
                        "parallel.ring_kv_keep_gb=9.5")  # fmt: skip
    kept_to = memory_plan(Placement.ZEPPELIN, lengths, capped, topology, shape)
    assert kept_to.placement(0).exchange is Exchange.RING


def test_the_planner_leaves_its_kept_rings_room_for_their_kv(one_node_positions) -> None:
    """13B on 256 GPUs of 64 GB, `bench scale`'s chat batch, USP positions of one node: held
    to a full rank's budget, the planner fills the long document's USP members with whole
    sequences and leaves them no room to keep its K/V (the backward sends them again);
    told what each token a member does not hold frees (`parallel.ring_kv_room_mb`,
    resolved from the memory model), it holds fewer whole sequences there and keeps
    them, as it does on many more rings, and every rank still fits the GPU. (On 80 GB the
    blocks' activations, `ray_zep.lean_ops`, leave the members room even when full.) No
    rank passes `KEEP_SHARE` of the GPU: a member the planner's room, counted ring by
    ring, left past it (by 1.2% here: 58.3 GB) has a smaller kept ring send its K/V again
    (`keep_where_room`)."""
    config, topology, shape = _setup("topology.nodes=32", "model.preset=13b",
                                     "train.tokens_per_rank=5120",
                                     "topology.gpu_memory_gb=64")  # fmt: skip
    lengths = batch_lengths("chat", 4096 * topology.world_size, 0)
    longest = int(np.argmax(lengths))
    planned = memory_plan(Placement.ZEPPELIN, lengths, config, topology, shape)
    budget, *_ = _setup("topology.nodes=32", "model.preset=13b", "train.tokens_per_rank=5120",
                        "parallel.ring_kv_room_mb=0", "topology.gpu_memory_gb=64")  # fmt: skip
    full = memory_plan(Placement.ZEPPELIN, lengths, budget, topology, shape)
    assert planned.placement(longest).ulysses > 1 and full.placement(longest).ulysses > 1
    assert planned.placement(longest).exchange is Exchange.RING_KEPT
    assert full.placement(longest).exchange is Exchange.RING

    def kept(plan: AttentionPlan) -> int:
        return sum(item.exchange is Exchange.RING_KEPT for item in plan.items())

    assert kept(planned) > 2 * kept(full)
    memory = plan_memory(config, topology, plan_stats(planned, shape), shape)
    assert memory.fits, memory.table()
    assert memory.ranks[memory.fullest].total <= KEEP_SHARE * topology.gpu_memory_bytes


def test_the_work_policys_fallback_keeps_within_the_budget_too() -> None:
    """A batch that fills every token falls back to the cost policy's splits (a rank may
    sit in two rings there); its rings keep their K/V as the work policy's would."""
    config = load_config(None, ["topology.nodes=2", "topology.gpus_per_node=2"])
    topology, shape = build_topology(config.topology), build_shape(config.model)
    lengths = np.asarray([1500, 1500, 1096])  # 4 x 1,024 tokens: no room for equal chunks
    cost = CostModel.create(shape, topology)
    with pytest.raises(PlacementError):  # what sends the work policy to the fallback
        balance(lengths, topology, 1024, WorkModel.create(shape, topology))
    for gb, kept in ((float("inf"), True), (0.0, False)):
        plan = plan_zeppelin(lengths, topology, 1024, cost, ZonePolicy.WORK, keep_kv_gb=gb)
        rings = [p for p in plan.placements if p.ring_size > 1]
        assert rings and all((p.exchange is Exchange.RING_KEPT) is kept for p in rings)
