"""Megatron-LM's packing-aware dynamic CP baseline in the simulator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_zep.errors import ConfigError, PlacementError
from ray_zep.sim.bytescale import simulate_schedule
from ray_zep.sim.compare import REFERENCE, VARIANTS, simulate_strategies
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.megatron_dynamic_cp import (
    NAME,
    WORKLOAD_CAP_SLACK,
    cp_needed,
    dataset_padded,
    dynamic_cp_plans,
    rank_micro_batches,
    schedule_micro_batches,
    simulate_dynamic_cp,
)
from ray_zep.topology import build_topology
from tests.helpers.baselines import RATES, L, small_config, small_run

pytestmark = pytest.mark.unit


def _reference(lengths: list[int], world: int, limit: int) -> list[list[tuple]]:
    """The scheduler spelled out rank by rank: every option's busiest rank is the maximum
    over all ranks' workloads; the fill doubles the first smallest group. Returns each
    micro-batch's (ranks, sequences) per group, in rank order."""
    pending = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out = []
    while pending:
        groups, pending = _reference_micro_batch(lengths, pending, world, limit)
        sizes = [g["size"] for g in groups]
        while sum(sizes) < world:
            sizes[sizes.index(min(sizes))] *= 2
        starts = np.cumsum([0, *sizes[:-1]]).tolist()
        placed = zip(starts, sizes, groups, strict=True)
        out.append([(tuple(range(a, a + n)), tuple(g["seqs"])) for a, n, g in placed])
    return out


def _reference_micro_batch(lengths, pending, world, limit) -> tuple[list[dict], list[int]]:
    """(groups in creation order: size, ranks, seqs, tokens per rank; the sequences left)."""
    load = [0.0] * world
    groups: list[dict] = []

    def put(seq: int, group: dict) -> None:
        s, cp = lengths[seq], group["size"]
        group["seqs"].append(seq)
        group["tokens"] += s / cp
        for r in group["ranks"]:
            load[r] += s * s / cp

    def opened(cp: int) -> dict:
        used = sum(g["size"] for g in groups)
        return {"size": cp, "ranks": list(range(used, used + cp)), "seqs": [], "tokens": 0.0}

    first = pending[0]
    groups.append(opened(cp_needed(lengths[first], limit)))
    put(first, groups[0])
    cap = lengths[first] * limit * (1 + WORKLOAD_CAP_SLACK)
    left = []
    for seq in pending[1:]:
        s, best = lengths[seq], None
        cp = cp_needed(s, limit)
        while cp <= world:
            options = [g for g in groups if g["size"] == cp and g["tokens"] + s / cp <= limit]
            if world - sum(g["size"] for g in groups) >= cp:
                options.append(None)
            for option in options:
                ranks = (option or opened(cp))["ranks"]
                peak = max(w + s * s / cp if r in ranks else w for r, w in enumerate(load))
                if peak <= cap and (best is None or peak < best[0]):
                    best = (peak, option, cp)
            cp *= 2
        if best is None:
            left.append(seq)
            continue
        if best[1] is None:
            groups.append(opened(best[2]))
        put(seq, best[1] or groups[-1])
    return groups, left


@pytest.mark.parametrize(
    ("length", "min_cp", "ranks"),
    [(1, 1, 1), (L, 1, 1), (L + 1, 1, 2), (2 * L, 1, 2), (2 * L + 1, 1, 4), (5 * L, 1, 8),
     (1, 4, 4), (9 * L, 4, 16)],
)  # fmt: skip
def test_a_sequence_needs_at_least_the_next_power_of_two_of_ranks(length, min_cp, ranks) -> None:
    assert cp_needed(length, L, min_cp) == ranks


@settings(max_examples=60, deadline=None)
@given(
    world=st.sampled_from([1, 2, 4, 8, 16]),
    limit=st.sampled_from([64, 256, 1000]),
    data=st.data(),
)
def test_micro_batches_place_every_sequence_once_in_aligned_groups_within_l_and_the_cap(
    world, limit, data
) -> None:
    lengths = data.draw(st.lists(st.integers(1, world * limit), min_size=1, max_size=40))
    micro_batches = schedule_micro_batches(np.asarray(lengths), world, limit)
    seen, tallest = [], None
    for wave in micro_batches:
        longest = max(lengths[s] for g in wave for s in g.seqs)
        assert tallest is None or longest <= tallest  # the longest left opens each one
        tallest, start, peak = longest, 0, 0.0
        for group in wave:
            cp = len(group.ranks)
            assert cp & (cp - 1) == 0 and start % cp == 0, wave  # Megatron's aligned blocks
            assert group.ranks == tuple(range(start, start + cp)) and group.seqs, wave
            assert all(cp_needed(lengths[s], limit) <= cp for s in group.seqs)
            assert sum(lengths[s] for s in group.seqs) / cp <= limit  # L tokens per rank
            peak = max(peak, sum(lengths[s] ** 2 / cp for s in group.seqs))
            start += cp
            seen += group.seqs
        assert start == world, wave  # no idle rank
        assert peak <= longest * limit * (1 + WORKLOAD_CAP_SLACK)
    assert sorted(seen) == list(range(len(lengths)))


@settings(max_examples=40, deadline=None)
@given(world=st.sampled_from([2, 4, 8, 16]), data=st.data())
def test_the_schedule_is_the_rank_by_rank_scheduler(world, data) -> None:
    lengths = data.draw(st.lists(st.integers(1, world * 300), min_size=1, max_size=30))
    got = schedule_micro_batches(np.asarray(lengths), world, 300)
    assert [[(g.ranks, g.seqs) for g in w] for w in got] == _reference(lengths, world, 300)


def test_short_sequences_are_packed_into_one_rank_groups_up_to_l() -> None:
    (wave,) = schedule_micro_batches(np.full(20, 100), 4, L)
    assert [g.ranks for g in wave] == [(0,), (1,), (2,), (3,)]
    assert [len(g.seqs) for g in wave] == [5] * 4
    first, second = schedule_micro_batches(np.full(50, 100), 4, L)
    assert [len(g.seqs) for g in first] == [10] * 4  # full: L tokens on every rank
    assert sum(len(g.seqs) for g in second) == 10


def test_a_sequence_takes_a_larger_group_only_where_that_lowers_the_busiest_rank() -> None:
    # 1001 tokens need 2 ranks (workload 1001^2 / 2); 1000 tokens alone on one rank would
    # double that, so they take a group of 2 too; the fill then doubles both.
    (wave,) = schedule_micro_batches(np.asarray([1001, 1000]), 8, L)
    assert [(g.ranks, g.seqs) for g in wave] == [((0, 1, 2, 3), (0,)), ((4, 5, 6, 7), (1,))]
    # 700 tokens cost less than the first group's ranks already carry: one rank of their own.
    (wave,) = schedule_micro_batches(np.asarray([1001, 700, 700]), 4, L)
    assert [(g.ranks, g.seqs) for g in wave] == [((0, 1), (0,)), ((2,), (1,)), ((3,), (2,))]


def test_plans_place_every_padded_token_once_one_ring_per_group() -> None:
    run = small_run("te_cp", 2, 4)
    rng = np.random.default_rng(5)
    lengths = np.concatenate([[5000, 2500], rng.integers(20, 900, size=30)])
    padded = dataset_padded(lengths, 8)
    assert np.all(padded % 16 == 0) and np.all((padded >= lengths) & (padded - lengths < 16))
    batches, plans = dynamic_cp_plans(lengths, run)
    assert len(plans) > 1
    assert rank_micro_batches(batches, 8).tolist() == [len(plans)] * 8
    placed = sorted(s for b in batches for s in b.seqs)
    assert placed == list(range(len(lengths)))
    assert sum(int(p.rank_tokens().sum()) for p in plans) == int(padded.sum())
    for index, plan in enumerate(plans):
        groups = [b for b in batches if b.round == index]
        assert sorted(r for b in groups for r in b.ranks) == list(range(8))
        assert plan.rank_tokens().max() <= L
        rings = [item for item in plan.items() if len(item.ranks) > 1]
        assert sorted(item.ranks for item in rings) == sorted(
            b.ranks for b in groups if len(b.ranks) > 1
        )
        for item in rings:  # TE's equal zigzag chunks
            assert len(set(plan.position_tokens(item))) == 1


def test_the_step_replays_the_micro_batches_and_counts_the_real_tokens() -> None:
    run = small_run("te_cp", 2, 4)
    lengths = np.asarray([5000, 2500, 900, 800, 700, 600, 500, 400, 300, 200] * 2)
    step = simulate_dynamic_cp(lengths, run)
    again = simulate_schedule(lengths, *dynamic_cp_plans(lengths, run), run)
    assert step.step_seconds == pytest.approx(again.step_seconds, rel=1e-12)
    assert step.tokens == int(lengths.sum()) and step.step_seconds > 0
    n_layers = run.shape.n_layers
    assert sum(step.breakdown(n_layers).values()) == pytest.approx(step.step_seconds)


def test_unschedulable_batches_raise_typed_errors_naming_the_cause() -> None:
    run = small_run("te_cp", 2, 4)
    with pytest.raises(PlacementError, match="needs more than 8 ranks"):
        simulate_dynamic_cp(np.asarray([8 * L + 1]), run)  # padded past 8 x L
    with pytest.raises(PlacementError, match="no sequences"):
        simulate_dynamic_cp(np.asarray([], dtype=np.int64), run)
    with pytest.raises(ConfigError, match="powers of two"):
        schedule_micro_batches(np.asarray([100, 200]), 12, L)
    with pytest.raises(ConfigError, match="min_dynamic_context_parallel_size"):
        schedule_micro_batches(np.asarray([100, 200]), 8, L, min_cp=3)


def test_simulate_reports_dynamic_cp_against_te_cp() -> None:
    variant = VARIANTS[NAME]
    assert variant.dynamic_cp and variant.scheduled and variant.te_wire
    config = small_config("te_cp", 2, 4)
    hardware = Hardware(build_topology(config.topology), RATES)
    batch = np.asarray([5000, 2500, 900, 800, 700, 600, 500, 400])
    results = simulate_strategies(config, hardware, [batch], (NAME, REFERENCE), L)
    assert results[NAME].error is None and results[REFERENCE].error is None
    assert results[NAME].steps[0].tokens == int(batch.sum())
    assert results[NAME].speedup_vs_te_cp > 0
    odd = dataclasses.replace(config, topology=dataclasses.replace(config.topology, nodes=3))
    hardware = Hardware(build_topology(odd.topology), RATES)
    refused = simulate_strategies(odd, hardware, [batch], (NAME, REFERENCE), L)
    assert "powers of two" in refused[NAME].error and refused[REFERENCE].error is None
