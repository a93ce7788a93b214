"""Planner invariants (hypothesis): tokens placed once, capacity L, zones, plan shapes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_zep.config import ParallelConfig, ZonePolicy, load_config
from ray_zep.costmodel import CostModel, kv_bytes_per_token
from ray_zep.errors import ConfigError, PlacementError
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import Placement
from ray_zep.partition import PLANNED, make_plan, plan_from_bins
from ray_zep.partition import stats as stats_module
from ray_zep.partition.fill import FILL_LOOP_BINS, water_fill
from ray_zep.partition.plan import Exchange, Zone, bounds_for_counts, even_bounds
from ray_zep.partition.stats import plan_stats, visible_pairs
from ray_zep.topology import LinkKind, build_topology

pytestmark = pytest.mark.unit

SHAPE = build_shape(load_config(None, ["model.n_heads=8", "model.n_kv_heads=2"]).model)


def _topology(nodes: int, gpus: int):
    return build_topology(
        load_config(None, [f"topology.nodes={nodes}", f"topology.gpus_per_node={gpus}"]).topology
    )


@st.composite
def batches(draw):
    nodes = draw(st.sampled_from([1, 2, 3]))
    gpus = draw(st.sampled_from([1, 2, 4]))
    capacity = draw(st.integers(8, 400))
    world = nodes * gpus
    total = draw(st.integers(1, world * capacity))
    kind = draw(st.sampled_from(["tiny", "mixed", "giant"]))
    lengths, left = [], total
    while left:
        if kind == "tiny":
            n = draw(st.integers(1, 5))
        elif kind == "giant" and not lengths:
            n = draw(st.integers(1, left))
        else:
            n = draw(st.integers(1, max(1, 2 * capacity)))
        n = min(n, left)
        lengths.append(n)
        left -= n
    return _topology(nodes, gpus), capacity, np.asarray(lengths)


def _coverage(plan) -> None:
    for p in plan.placements:
        seen = np.zeros(p.length, dtype=np.int64)
        for member in range(len(p.ranks)):
            for a, b in p.member_ranges(member):
                assert 0 <= a < b <= p.length
                seen[a:b] += 1
        assert np.all(seen == 1), f"sequence {p.seq}: tokens placed {seen.tolist()} times"


def _planned(strategy, lengths, topology, capacity, policy=ZonePolicy.COST):
    parallel = ParallelConfig(sequence=strategy, zone_policy=policy)
    try:
        return make_plan(strategy, lengths, topology, capacity, SHAPE, parallel)
    except ConfigError:
        assert strategy in (Placement.ULYSSES, Placement.USP)
        return None


@pytest.mark.parametrize("strategy", PLANNED, ids=lambda s: s.value)
@settings(max_examples=60, deadline=None)
@given(batch=batches())
def test_every_token_once_and_capacity_respected(strategy, batch) -> None:
    topology, capacity, lengths = batch
    plan = _planned(strategy, lengths, topology, capacity)
    if plan is None:
        return
    _coverage(plan)
    tokens = plan.rank_tokens()
    assert tokens.sum() == lengths.sum()
    assert tokens.max() <= capacity, f"rank holds {tokens.max()} > L={capacity}"
    layout_tokens = [sum(f.length for f in plan.layout(r)) for r in range(plan.world)]
    assert layout_tokens == tokens.tolist()


@pytest.mark.parametrize(
    "strategy", [Placement.ZEPPELIN, Placement.HYBRID_DP], ids=lambda p: p.value
)
@settings(max_examples=60, deadline=None)
@given(batch=batches())
def test_work_policy_places_every_token_once_within_capacity(strategy, batch) -> None:
    topology, capacity, lengths = batch
    plan = _planned(strategy, lengths, topology, capacity, ZonePolicy.WORK)
    _coverage(plan)
    assert plan.rank_tokens().max() <= capacity


@pytest.mark.parametrize("policy", [ZonePolicy.COST, ZonePolicy.CAPACITY], ids=lambda p: p.value)
@settings(max_examples=100, deadline=None)
@given(batch=batches())
def test_zeppelin_never_splits_a_sequence_shorter_than_the_local_threshold(policy, batch) -> None:
    """The paper's zone rule (the work policy splits by work and keeps no threshold)."""
    topology, capacity, lengths = batch
    plan = _planned(Placement.ZEPPELIN, lengths, topology, capacity, policy)
    _coverage(plan)
    assert plan.rank_tokens().max() <= capacity
    for node in range(topology.nodes):
        on_node = set(topology.ranks_of_node(node))
        here = [p for p in plan.placements if on_node & set(p.ranks)]
        split = [p.length for p in here if len(p.ranks) > 1]
        threshold = min(split, default=np.inf)
        local = [p.length for p in here if len(p.ranks) == 1]
        assert all(n < threshold or n == threshold for n in local), (
            f"node {node}: local lengths {local} reach split lengths {split}"
        )
        assert max(local, default=0) <= threshold


def test_zeppelin_keeps_short_sequences_local_and_spreads_a_giant() -> None:
    topology = _topology(2, 4)
    lengths = np.asarray([5000, *[50] * 40])  # a node holds 4 x 1024 tokens
    plan = make_plan(Placement.ZEPPELIN, lengths, topology, 1024, SHAPE)
    assert plan.zone(0) is Zone.INTER_NODE
    assert all(plan.zone(i) is Zone.LOCAL for i in range(1, len(lengths)))


def test_te_cp_puts_every_sequence_on_one_global_ring() -> None:
    topology = _topology(2, 2)
    plan = make_plan(Placement.TE_CP, [1, 3, 7, 100], topology, 64, SHAPE)
    (item,) = plan.items()
    assert item.ranks == (0, 1, 2, 3) and item.zone is Zone.INTER_NODE
    assert item.exchange is Exchange.RING
    llama = make_plan(Placement.LLAMA_CP, [1, 3, 7, 100], topology, 64, SHAPE)
    assert llama.items()[0].exchange is Exchange.ALL_GATHER


def test_zigzag_chunks_give_rank_i_chunks_i_and_2g_minus_1_minus_i() -> None:
    bounds = even_bounds(16, 4)
    assert bounds == (0, 2, 4, 6, 8, 10, 12, 14, 16)
    from ray_zep.partition.plan import SeqPlacement

    p = SeqPlacement(0, 16, (0, 1, 2, 3), bounds)
    assert p.member_ranges(0) == [(0, 2), (14, 16)]
    assert p.member_ranges(3) == [(6, 10)]  # chunks 3 and 4 are adjacent
    assert bounds_for_counts([3, 1, 0]) == (0, 1, 1, 1, 1, 2, 4)


def test_water_fill_is_even_within_capacity() -> None:
    assert water_fill(10, np.asarray([2, 10, 10])).tolist() == [2, 4, 4]
    assert water_fill(7, np.asarray([5, 5, 5])).tolist() == [2, 2, 3]
    with pytest.raises(PlacementError):
        water_fill(11, np.asarray([5, 5]))


def test_water_fill_on_arrays_walks_the_bins_as_one_by_one() -> None:
    """Past `FILL_LOOP_BINS` the shares come from arrays: the same as walking the bins by
    room, each taking the smaller of its room and the rest over the bins left."""

    def walked(total: int, free: np.ndarray) -> list[int]:
        shares, remaining = [0] * free.size, total
        for done, index in enumerate(np.argsort(free, kind="stable").tolist()):
            shares[index] = min(int(free[index]), remaining // (free.size - done))
            remaining -= shares[index]
        return shares

    rng = np.random.default_rng(0)
    for case in range(600):
        bins = int(rng.integers(FILL_LOOP_BINS + 1, 300))
        kinds = (rng.integers(0, 6000, bins), rng.choice([0, 1, 2560, 5120], bins),
                 np.full(bins, int(rng.integers(0, 40))), rng.integers(0, 3, bins))  # fmt: skip
        free = kinds[case % 4]
        total = int(rng.integers(0, int(free.sum()) + 1)) if case % 5 else int(free.sum())
        assert water_fill(total, free).tolist() == walked(total, free), (total, free.tolist())


def test_planners_refuse_a_batch_larger_than_the_ranks() -> None:
    with pytest.raises(PlacementError, match="tokens_per_rank=10"):
        make_plan(Placement.ZEPPELIN, [25, 20], _topology(1, 4), 10, SHAPE)


def test_ulysses_head_rules_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"model\.n_heads=8 divisible by 3"):
        make_plan(Placement.ULYSSES, [10], _topology(1, 3), 10, SHAPE)


def test_stats_count_causal_pairs_exactly() -> None:
    assert visible_pairs(0, 4) == 10
    plan = plan_from_bins([4, 2], [[0], [1]], _topology(1, 2), 8, Placement.WHOLE)
    stats = plan_stats(plan, SHAPE)
    per_pair = 4 * SHAPE.n_heads * SHAPE.head_dim
    assert stats.attention_flops.tolist() == [10 * per_pair, 3 * per_pair]
    assert stats.total_bytes(LinkKind.INTER_NODE) == 0
    ring = make_plan(Placement.TE_CP, [8], _topology(1, 2), 8, SHAPE)
    flops = plan_stats(ring, SHAPE).attention_flops
    assert flops.sum() == visible_pairs(0, 8) * per_pair
    assert flops[0] == flops[1], "zigzag balances causal work"


@pytest.mark.parametrize("strategy", PLANNED, ids=lambda s: s.value)
@settings(max_examples=40, deadline=None)
@given(batch=batches(), policy=st.sampled_from(list(ZonePolicy)))
def test_stats_on_arrays_equal_the_member_by_member_sums(strategy, batch, policy) -> None:
    """Ulysses-free plans are costed all members at once; the figures equal, exactly,
    the sums over each item's members in turn."""
    topology, capacity, lengths = batch
    plan = _planned(strategy, lengths, topology, capacity, policy)
    items = plan.items() if plan is not None else []
    if not items or any(item.ulysses > 1 for item in items):
        return
    fast = plan_stats(plan, SHAPE)
    world = plan.world
    sums = stats_module._Sums(
        np.zeros(world), np.zeros(world),
        {kind: np.zeros(world, dtype=np.int64) for kind in LinkKind},
        {kind: np.zeros(world, dtype=np.int64) for kind in LinkKind},
    )  # fmt: skip
    cost = CostModel.create(SHAPE, topology)
    zones = stats_module._add_items(plan, items, SHAPE, cost, sums)
    assert fast.zones == zones
    assert fast.attention_flops.tolist() == sums.flops.tolist()
    assert fast.seconds.tolist() == sums.seconds.tolist()
    for kind in LinkKind:
        assert fast.sent_bytes[kind].tolist() == sums.sent[kind].tolist()
        assert fast.collective_bytes[kind].tolist() == sums.collective[kind].tolist()


@pytest.mark.parametrize("strategy", PLANNED, ids=lambda s: s.value)
@settings(max_examples=20, deadline=None)
@given(batch=batches())
def test_member_token_counts_equal_each_members_tokens(strategy, batch) -> None:
    """The array form the statistics read (Ulysses members cut as `member_ranges` cuts)."""
    topology, capacity, lengths = batch
    plan = _planned(strategy, lengths, topology, capacity, ZonePolicy.WORK)
    for p in plan.placements if plan is not None else ():
        counts = [p.member_tokens(m) for m in range(len(p.ranks))]
        assert p.member_token_counts().tolist() == counts, p


def test_modelled_time_overlaps_ring_transfer_with_compute() -> None:
    topology = _topology(2, 1)
    cost = CostModel.create(SHAPE, topology)
    local = plan_stats(plan_from_bins([64], [[0], []], topology, 64, Placement.WHOLE), SHAPE)
    assert local.seconds[0] == pytest.approx(cost.attention_seconds(local.attention_flops[0]))
    assert local.seconds[1] == 0.0
    ring = plan_stats(make_plan(Placement.TE_CP, [64], topology, 64, SHAPE), SHAPE)
    share = cost.attention_seconds(ring.attention_flops.max()) / 2
    step = cost.transfer_seconds(32 * kv_bytes_per_token(SHAPE), LinkKind.INTER_NODE, True)
    assert ring.layer_seconds == pytest.approx(share + max(share, step))
    assert ring.layer_seconds > local.layer_seconds / 2, "one ring step cannot be free"
