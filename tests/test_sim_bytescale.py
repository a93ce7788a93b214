"""ByteScale's hybrid data parallelism baseline in the simulator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_zep.config import Config
from ray_zep.errors import PlacementError
from ray_zep.parallel.axes import Placement
from ray_zep.partition import plan_from_bins
from ray_zep.sim.bytescale import (
    NAME,
    bytescale_plans,
    micro_batches,
    schedule,
    simulate_bytescale,
)
from ray_zep.sim.compare import VARIANTS, simulate_strategies
from ray_zep.sim.step import RunModel, simulate_plan
from tests.helpers.baselines import L, small_config, small_run

pytestmark = pytest.mark.unit


def _config(nodes: int, gpus: int) -> Config:
    return small_config("hybrid_dp", nodes, gpus)


def _run(nodes: int = 2, gpus: int = 4) -> RunModel:
    return small_run("hybrid_dp", nodes, gpus)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 3 * L), min_size=1, max_size=30))
def test_long_sequences_get_ceil_s_over_c_ranks_and_short_ones_fill_bins(lengths) -> None:
    lengths = np.asarray(lengths)
    units = micro_batches(lengths, L)
    seen = sorted(s for seqs, _ in units for s in seqs)
    assert seen == list(range(len(lengths)))
    for seqs, ranks in units:
        if ranks > 1:
            assert len(seqs) == 1 and ranks == -(-int(lengths[seqs[0]]) // L)
        else:
            assert lengths[list(seqs)].sum() <= L
    short = lengths[lengths <= L]
    bins = sum(ranks == 1 for _, ranks in units)
    assert bins < 2 * -(-int(short.sum()) // L) + 1  # best fit wastes less than half a bin


def test_a_rounds_micro_batches_hold_disjoint_ranks_and_a_rank_runs_them_in_order() -> None:
    run = _run()
    rng = np.random.default_rng(3)
    lengths = np.concatenate([[3500, 2100], rng.integers(20, 900, size=40)])
    batches, plans = bytescale_plans(lengths, run)
    assert len(plans) > 1
    for index, plan in enumerate(plans):
        ranks = [r for b in batches if b.round == index for r in b.ranks]
        assert len(ranks) == len(set(ranks))
        assert plan.rank_tokens().max() <= L
    last = {}
    for batch in batches:  # handed out in order: a rank's rounds only grow
        for rank in batch.ranks:
            assert batch.round > last.get(rank, -1)
            last[rank] = batch.round
    # ranks holding a split sequence run fewer micro-batches than the busiest others
    counts = np.bincount([r for b in batches for r in b.ranks], minlength=8)
    ring_ranks = [r for b in batches if len(b.ranks) > 1 for r in b.ranks]
    assert counts[ring_ranks].min() < counts.max()


@pytest.mark.parametrize("mixed", [False, True])
def test_one_round_of_whole_micro_batches_is_the_packed_plans_step(mixed: bool) -> None:
    run = _run()
    lengths = np.asarray([900, 800, 700, 600, 500, 400, 300, 200] if mixed else [L] * 8)
    batches, plans = bytescale_plans(lengths, run)
    assert len(plans) == 1 and all(len(b.ranks) == 1 for b in batches)
    bins = [[] for _ in range(8)]
    for batch in batches:
        bins[batch.ranks[0]] += batch.seqs
    packed = simulate_plan(
        plan_from_bins(lengths, bins, run.hardware.topology, L, Placement.WHOLE), run
    )
    step = simulate_bytescale(lengths, run)
    if mixed:  # the rank with the longest layers (one 900) is not the one with most tokens
        layers = run.shape.n_layers * (packed.forward_layer_seconds + packed.backward_layer_seconds)
        assert layers < step.step_seconds < packed.step_seconds
    else:
        assert step.step_seconds == pytest.approx(packed.step_seconds, rel=1e-12)
    assert sum(step.breakdown(run.shape.n_layers).values()) == pytest.approx(step.step_seconds)


def test_micro_batches_on_a_rank_run_one_after_another_and_sync_once() -> None:
    run = _run(1, 4)
    one = simulate_bytescale(np.full(4, L), run)
    two = simulate_bytescale(np.full(8, L), run)
    once = one.grad_sync_seconds + one.optimizer_seconds + one.fixed_seconds
    assert once > 0
    assert two.step_seconds - once == pytest.approx(2 * (one.step_seconds - once), rel=1e-9)
    assert two.tokens == 8 * L


def test_bytescale_is_a_variant_and_refuses_a_sequence_wider_than_the_world() -> None:
    run = _run()
    assert VARIANTS[NAME].bytescale and VARIANTS[NAME].scheduled
    config = _config(2, 4)
    results = simulate_strategies(config, run.hardware, [np.asarray([2500, 900, 40])], (NAME,), L)
    assert results[NAME].error is None and results[NAME].step_seconds > 0
    with pytest.raises(PlacementError, match="needs 9 ranks"):
        schedule(np.asarray([8001]), run)
    with pytest.raises(PlacementError, match="no sequences"):
        schedule(np.asarray([], dtype=np.int64), run)
