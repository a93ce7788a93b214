"""The level scan's early bound (`ray_zep.partition.level_scan`): it abandons the slow
lowest levels sooner and changes no placement."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

import ray_zep.partition.balance as balance_module
import ray_zep.partition.level_fill as level_fill
import ray_zep.partition.level_scan as level_scan
import ray_zep.partition.wide_guests as wide_guests
from ray_zep.config import load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.errors import PlacementError
from ray_zep.partition.level_fill import Placed
from ray_zep.partition.level_scan import LevelScan, ScanRules
from ray_zep.partition.level_trace import LevelOutcome, LevelTry
from ray_zep.partition.stats import plan_stats
from ray_zep.report.placement import summary_line
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel, plan_batch
from ray_zep.topology import build_topology
from tests.helpers.scenarios import WHOLE_EXCHANGES

pytestmark = pytest.mark.unit

RULES = ScanRules(balance_module.LEVELS, balance_module.PAST_FIRST, balance_module.BISECTIONS,
                  balance_module.BISECT_BELOW_OVERFLOW,
                  balance_module.BISECT_ABOVE_OVERFLOW,
                  balance_module.BISECT_BELOW_LOST,
                  balance_module.BISECT_ABOVE_LOST)  # fmt: skip


class FakeLevels:
    """Levels whose placements are drawn at random, placed as `_place_at` places one: the
    rings first (they fit or not; their busiest rank), then whole sequences raise the
    busiest rank to its end value, abandoned once it reaches the bound; a fill that runs
    out of tokens does so when the busiest rank passes `fails_at`."""

    def __init__(self, seed: int) -> None:
        self.seed, self.levels, self.calls = seed, {}, []

    def _draw(self, factor: float) -> tuple:
        rng = random.Random(f"{self.seed}:{factor!r}")  # the same, whichever level comes first
        if rng.random() < 0.3 * max(0.0, 1.6 - factor) / 0.6:  # low levels' rings overflow
            return ("rings",)
        rings = round(rng.uniform(0.8, 1.2) * factor, 1)
        end = max(rings, round(rng.uniform(0.9, 1.6) * factor, 1))  # ties are common
        fails_at = round(rng.uniform(rings, end), 1) if rng.random() < 0.15 else None
        fits = fails_at is None and rng.random() < 0.8
        return ("placed", rings, end, fails_at, fits)

    def place(self, factor: float, prune_above: float, force: bool, failed) -> Placed | None:
        self.calls.append((factor, prune_above))
        if factor not in self.levels:
            self.levels[factor] = self._draw(factor)
        drawn = self.levels[factor]
        if drawn[0] == "rings" and not force:
            if failed is not None:
                failed.append(LevelTry(0.0, LevelOutcome.RINGS))
            return None
        _, rings, end, fails_at, fits = drawn if drawn[0] == "placed" else (0, 9.0, 9.0, None, 1)
        placed = Placed(np.asarray([rings]), np.zeros(1, dtype=np.int64), np.zeros(1, bool))
        placed.fill_fits = bool(fits)
        if rings >= prune_above:
            placed.pruned = True
            return placed
        if fails_at is not None and fails_at < prune_above:
            raise PlacementError("tokens")
        placed.load[0] = end
        placed.pruned = end >= prune_above
        return placed


def _scan(seed: int, overflow: float) -> tuple:
    fake = FakeLevels(seed)
    scan = LevelScan(fake.place, 1.0, RULES, trace := [])
    level_scan.OVERFLOW, saved = overflow, level_scan.OVERFLOW
    try:
        kept = scan.best() or scan.forced()
    except PlacementError as error:
        return ("raised", str(error)), fake, trace
    finally:
        level_scan.OVERFLOW = saved
    scan.mark_kept(kept)
    return (kept.busiest, [t.factor for t in scan.tried if t.placed is kept]), fake, trace


@pytest.mark.parametrize("overflow", [0.0, 0.1, 0.4])
def test_the_early_bound_keeps_the_placement_the_plain_scan_keeps(overflow: float) -> None:
    """Thousands of random level outcomes (rings that do not fit, fills out of tokens,
    ties, fills that may or may not run out of tokens): the scan with the early bound
    keeps the same level's placement as without it, tries the same levels (its trace:
    the same factors, the same kept one), and on many it abandons some level at a lower
    bound than the plain scan does."""
    tighter = 0
    for seed in range(1500):
        plain, plain_fake, plain_trace = _scan(seed, math.inf)
        early, early_fake, early_trace = _scan(seed, overflow)
        assert early == plain, seed
        assert [t.factor for t in early_trace] == [t.factor for t in plain_trace], seed
        kept = [t.factor for t in early_trace if t.outcome is LevelOutcome.KEPT]
        assert kept == [t.factor for t in plain_trace if t.outcome is LevelOutcome.KEPT], seed
        bounds = dict(plain_fake.calls)
        tighter += any(bound < bounds.get(factor, -1) for factor, bound in early_fake.calls)
    assert tighter > 150


def _run(gpus: int, model: str, capacity: int = 5120) -> RunModel:
    config = load_config(None, ["topology.preset=cluster_a", f"topology.nodes={gpus // 8}",
                                f"model.preset={model}", f"train.tokens_per_rank={capacity}",
                                "parallel.weights=fsdp", "parallel.sequence=zeppelin",
                                WHOLE_EXCHANGES])  # fmt: skip
    return RunModel.create(config, Hardware.preset(build_topology(config.topology)))


@pytest.mark.parametrize(("gpus", "model", "seed"), [(1024, "13b", 0), (1024, "13b", 5)])
def test_the_early_bound_changes_no_placement_and_deals_fewer_sequences(
    monkeypatch: pytest.MonkeyPatch, gpus: int, model: str, seed: int
) -> None:
    """Chat batches whose first feasible level passes it by more than `OVERFLOW` (whole
    sequences kept from riding as second rings, `ray_zep.partition.co_rings`, and groups
    of positions wider than a node from hosting guests, `ray_zep.partition.wide_guests`,
    with either of which no first level of these batches passes it): the plans with and
    without the early bound are equal (also where no fill is trusted not to run out of
    tokens, and every level abandoned early is placed again), the early
    bound deals fewer whole sequences, and the trace says of a lower level it abandoned
    what its rank passed."""
    run, lengths = _run(gpus, model), batch_lengths("chat", 4096 * gpus, seed)
    dealt = [0]
    fill_whole = balance_module.fill_whole

    def counting(placed, *args):  # the sequences each fill went through
        fill_whole(placed, *args)
        dealt[0] += placed.dealt

    monkeypatch.setattr(balance_module, "fill_whole", counting)
    monkeypatch.setattr(level_fill, "SECOND_RINGS", False)
    monkeypatch.setattr(wide_guests, "WIDE_HOSTS", False)

    def plan(overflow: float):
        dealt[0] = 0
        monkeypatch.setattr(level_scan, "OVERFLOW", overflow)
        planned, _ = plan_batch(lengths, run)
        return planned, dealt[0]

    overflow = level_scan.OVERFLOW
    plain, plain_dealt = plan(math.inf)  # never past its bound: no guess, no early bound
    early, early_dealt = plan(overflow)
    assert early.placements == plain.placements
    assert early_dealt < plain_dealt
    assert [t.factor for t in early.levels] == [t.factor for t in plain.levels]
    abandoned = 0
    for mine, theirs in zip(early.levels, plain.levels, strict=True):
        if mine.outcome is LevelOutcome.PRUNED and not math.isnan(mine.busiest):
            abandoned += 1  # what the plain scan placed, or abandoned at its own bound
            assert theirs.outcome in (LevelOutcome.PLACED, LevelOutcome.PRUNED)
            assert theirs.outcome is LevelOutcome.PRUNED or theirs.busiest >= mine.busiest
        else:
            assert mine == theirs or mine.busiest == pytest.approx(theirs.busiest, rel=1e-12)
    assert abandoned
    shown = summary_line(early, plan_stats(early, run.shape))
    assert "a rank passed" in shown
    monkeypatch.setattr(balance_module, "whole_sequences_fit", lambda *args: False)
    distrusted, _ = plan(overflow)
    assert distrusted.placements == plain.placements


def test_the_halving_stops_at_a_level_that_cannot_win(monkeypatch: pytest.MonkeyPatch) -> None:
    """7b arxiv at 1,024 GPUs: the halving under the first feasible level finds a level
    abandoned at the busiest rank so far; the scan stops there (`BISECT_BELOW_LOST` off)
    and keeps the placement it keeps going on, one level sooner (the gap above it left
    unhalved, `BISECT_ABOVE_LOST` off)."""
    run, lengths = _run(1024, "7b"), batch_lengths("arxiv", 4096 * 1024, 0)
    monkeypatch.setattr(balance_module, "BISECT_ABOVE_LOST", 0)

    def plan(below_lost: bool):
        monkeypatch.setattr(balance_module, "BISECT_BELOW_LOST", below_lost)
        planned, _ = plan_batch(lengths, run)
        return planned

    going_on, stopping = plan(True), plan(False)
    assert stopping.placements == going_on.placements
    factors = [t.factor for t in stopping.levels]
    assert factors == [t.factor for t in going_on.levels][: len(factors)]
    assert len(factors) < len(going_on.levels)
    assert stopping.levels[-1].outcome is LevelOutcome.PRUNED


def test_the_gap_above_a_level_that_cannot_win_is_halved(monkeypatch: pytest.MonkeyPatch) -> None:
    """13b github at 256 GPUs, L = 7,680: the first feasible level (1.15) wins, and the
    halving under it stops at 1.125, abandoned at its busiest rank (its whole sequences
    overflowed it). Halving the gap between the two instead (`BISECT_ABOVE_LOST`) places
    levels there, and one ends 1.4% less busy than the level the scan kept without it."""
    run = _run(256, "13b", capacity=7680)
    lengths = batch_lengths("github", 4096 * 256, 0)

    def levels(halvings: int) -> list[LevelTry]:
        monkeypatch.setattr(balance_module, "BISECT_ABOVE_LOST", halvings)
        planned, _ = plan_batch(lengths, run)
        return list(planned.levels)

    def kept(tried: list[LevelTry]) -> LevelTry:
        return next(t for t in tried if t.outcome is LevelOutcome.KEPT)

    halvings = balance_module.BISECT_ABOVE_LOST
    plain, halved = levels(0), levels(halvings)
    assert plain[-1].outcome is LevelOutcome.PRUNED
    lost, winner = plain[-1].factor, kept(plain).factor
    assert lost < winner
    assert [t.factor for t in halved][: len(plain)] == [t.factor for t in plain]
    assert all(lost < t.factor < winner for t in halved[len(plain) :])
    assert lost < kept(halved).factor < winner
    assert kept(halved).busiest < kept(plain).busiest * 0.99
