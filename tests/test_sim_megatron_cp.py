"""Megatron-Core's hybrid DP x CP baseline and TransformerEngine's CP padding in the simulator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_zep.config import Config
from ray_zep.errors import ConfigError, PlacementError
from ray_zep.partition.plan import Zone
from ray_zep.sim.compare import (
    REFERENCE,
    VARIANTS,
    simulate_strategies,
    simulate_te_padded,
    strategy_names,
)
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.megatron_cp import (
    NAME,
    gpus_needed,
    schedule_waves,
    simulate_hybrid_cp,
    te_padded,
    wave_plan,
)
from ray_zep.sim.step import RunModel, plan_batch, simulate_batch, simulate_plan
from ray_zep.topology import build_topology
from tests.helpers.baselines import RATES, L, small_config, small_run

pytestmark = pytest.mark.unit

MIXED = np.asarray([5000, 3000, 900, 800, 700, 600, 500, 400, 300, 200] * 2)
"""Two sequences of CP 8, two of CP 4 and short ones on 8 ranks: three waves."""


def _config(nodes: int, gpus: int, weights: str = "replicated") -> Config:
    return small_config("te_cp", nodes, gpus, weights)


def _run(nodes: int = 2, gpus: int = 4) -> RunModel:
    return small_run("te_cp", nodes, gpus)


@pytest.mark.parametrize(
    ("length", "ranks"), [(1, 1), (1000, 1), (1001, 2), (2000, 2), (2001, 4), (5000, 8)]
)
def test_a_sequence_needs_the_next_power_of_two_of_ranks(length: int, ranks: int) -> None:
    assert gpus_needed(length, L) == ranks


@settings(max_examples=40, deadline=None)
@given(
    world=st.sampled_from([1, 2, 4, 8, 16]),
    limit=st.sampled_from([64, 256, 1000]),
    data=st.data(),
)
def test_waves_tile_the_ranks_with_aligned_power_of_two_groups(world, limit, data) -> None:
    lengths = data.draw(st.lists(st.integers(1, world * limit), min_size=1, max_size=40))
    waves = schedule_waves(np.asarray(lengths), world, limit)
    seen = []
    for wave in waves:
        start = 0
        for group in wave:
            size = len(group.ranks)
            assert size & (size - 1) == 0, group
            assert group.ranks == tuple(range(start, start + size)), wave
            assert start % size == 0, wave  # Megatron's groups of each size are aligned
            assert group.seqs, wave
            assert all(gpus_needed(lengths[s], limit) <= size for s in group.seqs)
            start += size
            seen += group.seqs
        assert start == world, wave
    assert sorted(seen) == list(range(len(lengths)))


def test_a_wave_whose_leftovers_start_small_still_runs_on_aligned_groups() -> None:
    # the third wave's groups are made 1, 8, 4 ranks wide in that order: laid out as
    # made, the group of 8 would start at rank 4, where Megatron has no group of 8
    waves = schedule_waves(np.asarray([1, 129, 129, 129, 129, 129, 257, 257, 257]), 16, 64)
    assert [[g.ranks[0] for g in wave] for wave in waves][-1] == [0, 8, 12]
    assert [len(g.ranks) for g in waves[-1]] == [8, 4, 4]


def test_short_sequences_make_one_wave_of_pure_dp() -> None:
    lengths = np.random.default_rng(0).integers(50, L + 1, size=40)
    waves = schedule_waves(lengths, 8, L)
    assert len(waves) == 1
    assert [g.ranks for g in waves[0]] == [(r,) for r in range(8)]
    plan, order = wave_plan(lengths, waves[0], build_topology(_config(2, 4).topology), L)
    assert {plan.zone(i) for i in range(len(order))} == {Zone.LOCAL}
    assert np.array_equal(plan.lengths, lengths[order])  # one rank: no padding


def test_a_long_sequence_runs_on_its_power_of_two_group() -> None:
    lengths = np.asarray([5000] + [900] * 16)
    (wave,) = schedule_waves(lengths, 16, L)
    (long_group,) = [g for g in wave if 0 in g.seqs]
    assert long_group.ranks == tuple(range(8)) and long_group.seqs == (0,)
    plan, order = wave_plan(lengths, wave, build_topology(_config(4, 4).topology), L)
    placement = plan.placement(int(np.flatnonzero(order == 0)[0]))
    assert placement.length == 5008  # padded to a multiple of 2 x 8
    assert [placement.member_tokens(m) for m in range(8)] == [626] * 8


def test_wave_plans_place_every_token_once_padded_per_group() -> None:
    topology = build_topology(_config(2, 4).topology)
    waves = schedule_waves(MIXED, 8, L)
    assert len(waves) == 3
    placed = []
    for wave in waves:
        plan, order = wave_plan(MIXED, wave, topology, L)
        sizes = {s: len(g.ranks) for g in wave for s in g.seqs}
        for i, seq in enumerate(order.tolist()):
            cp, n = sizes[seq], int(plan.lengths[i])
            assert n >= MIXED[seq] and n - MIXED[seq] < 2 * cp and (cp == 1 or n % (2 * cp) == 0)
        assert plan.rank_tokens().sum() == plan.lengths.sum()
        placed += order.tolist()
    assert sorted(placed) == list(range(len(MIXED)))


def test_step_is_the_waves_layers_and_heads_plus_one_sync() -> None:
    run = _run()
    step = simulate_hybrid_cp(MIXED, run)
    plans = [wave_plan(MIXED, w, run.hardware.topology, L)[0] for w in schedule_waves(MIXED, 8, L)]
    waves = [simulate_plan(plan, run) for plan in plans]
    n_layers = run.shape.n_layers
    per_wave = [
        n_layers * (w.forward_layer_seconds + w.backward_layer_seconds) + w.head_seconds
        for w in waves
    ]
    once = waves[0].grad_sync_seconds + waves[0].optimizer_seconds + waves[0].fixed_seconds
    assert once > 0 and len(waves) == 3
    assert step.step_seconds == pytest.approx(sum(per_wave) + once, rel=1e-12)
    assert step.step_seconds < sum(w.step_seconds for w in waves)  # the sync is paid once
    assert step.tokens == int(MIXED.sum())
    assert sum(step.breakdown(n_layers).values()) == pytest.approx(step.step_seconds)


def test_hybrid_cp_refuses_a_world_that_is_not_a_power_of_two() -> None:
    with pytest.raises(ConfigError, match="powers of two"):
        schedule_waves(np.asarray([100, 200]), 12, L)
    with pytest.raises(PlacementError, match="needs more than 8 ranks"):
        schedule_waves(np.asarray([8001]), 8, L)


def test_te_padding_pads_to_2cp_and_never_lowers_the_step() -> None:
    run = _run()
    rng = np.random.default_rng(1)
    for _ in range(3):
        lengths = rng.integers(1, 900, size=8)
        padded = te_padded(lengths, 8)
        assert np.all(padded % 16 == 0) and np.all((padded >= lengths) & (padded - lengths < 16))
        plan, _ = plan_batch(padded, run)
        counts = plan.rank_tokens()
        assert counts.min() == counts.max()  # equal chunks, as TE slices them
        unpadded = simulate_batch(lengths, run)
        step = simulate_te_padded(lengths, run)
        assert step.step_seconds >= unpadded.step_seconds
        assert step.tokens == int(lengths.sum()) and step.tokens_per_second > 0


def test_te_padding_past_capacity_trains_the_padded_batch() -> None:
    run = _run()
    lengths = np.asarray([L - 1] * 8)  # exactly 8 x L - 8 tokens: padding overflows L
    padded = te_padded(lengths, 8)
    assert padded.sum() > 8 * L
    with pytest.raises(PlacementError):
        simulate_batch(padded, run)
    step = simulate_te_padded(lengths, run)
    assert step.tokens == int(lengths.sum())
    assert step.step_seconds >= simulate_batch(lengths, run).step_seconds


def test_simulate_reports_megatron_by_default_against_padded_te_cp() -> None:
    names = strategy_names(None, False)
    assert NAME in names and REFERENCE in names
    assert VARIANTS[NAME].te_wire and VARIANTS[REFERENCE].te_padding
    config = _config(2, 4)
    hardware = Hardware(build_topology(config.topology), RATES)
    results = simulate_strategies(config, hardware, [MIXED[:12]], (NAME, REFERENCE), 3 * L)
    for name in (NAME, REFERENCE):
        assert results[name].error is None
        assert results[name].steps[0].tokens == int(MIXED[:12].sum())
    assert results[REFERENCE].speedup_vs_te_cp == 1.0
    assert results[NAME].speedup_vs_te_cp > 0
    small = dataclasses.replace(config, topology=dataclasses.replace(config.topology, nodes=3))
    hardware = Hardware(build_topology(small.topology), RATES)
    odd = simulate_strategies(small, hardware, [MIXED[:12]], (NAME, REFERENCE), 2 * L)
    assert "powers of two" in odd[NAME].error and odd[REFERENCE].error is None
