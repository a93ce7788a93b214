"""The levels of work the balanced placement tries, as `ray-zep plan` reports them
(`ray_zep.partition.level_trace`)."""

from __future__ import annotations

import numpy as np
import pytest

import ray_zep.partition.balance as balance_module
from ray_zep.config import load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.partition.level_trace import LevelOutcome
from ray_zep.partition.stats import plan_stats
from ray_zep.report.placement import plan_record, summary_line
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel, plan_batch
from ray_zep.topology import build_topology

pytestmark = pytest.mark.unit


def _run(nodes: int, placement: str = "zeppelin") -> RunModel:
    config = load_config(None, ["topology.preset=cluster_a", f"topology.nodes={nodes}",
                                "model.preset=7b", "train.tokens_per_rank=5120",
                                "parallel.weights=fsdp",
                                f"parallel.sequence={placement}"])  # fmt: skip
    return RunModel.create(config, Hardware.preset(build_topology(config.topology)))


def test_the_trace_is_what_the_planner_tried_and_the_summary_says_why_no_lower_level(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """256 GPUs, github, 4k tokens per GPU: every level the planner places is in the trace
    with what it gave (spied on the planner itself), the kept one is the placed level
    with the lowest busiest rank, and `ray-zep plan`'s summary names it and why the lower
    ones failed: the rings of the five 120k-170k-token documents and their 8k-48k-token
    neighbours alone take more than the 256 ranks; above those, a level whose whole
    sequences overflowed it, and the levels tried between it and the winner
    (`BISECT_ABOVE_OVERFLOW`), each ended or was abandoned busier than the kept one. A
    level placed again with its USP exchanges costed whole is one try, as the retry gave
    it (`balance.WHOLE_COST_RETRY`)."""
    seen = []
    place_at = balance_module._place_at
    run = _run(32)
    pieces = run.config.parallel.ulysses_chunks

    def spy(lengths, work, small, level, topology, *rest, **options):
        mean = float(work.sum()) / topology.world_size
        if options.get("forward_room"):  # the kept level again (`forward_room`): no try
            placed = place_at(lengths, work, small, level, topology, *rest, **options)
            again.append((level / mean, placed))
            return placed
        if rest[1].ulysses_pieces == 1 < pieces and seen and seen[-1] == (level / mean, None):
            seen.pop()  # the level again, its exchanges costed whole (`WHOLE_COST_RETRY`):
            made.pop()  # the trace keeps what the retry gave
        try:
            placed = place_at(lengths, work, small, level, topology, *rest)
        except Exception:
            seen.append((level / mean, "raised"))
            raise
        seen.append((level / mean, None if placed is None else placed.pruned))
        made.append(placed)
        return placed

    made, returned, again = [], [], []
    placements = balance_module._placements

    def returning(lengths, placed, model):
        returned.append(placed)
        return placements(lengths, placed, model)

    monkeypatch.setattr(balance_module, "_place_at", spy)
    monkeypatch.setattr(balance_module, "_placements", returning)
    lengths = batch_lengths("github", 4096 * 256, 0)
    plan, _ = plan_batch(lengths, run)
    levels = plan.levels
    assert len(levels) == len(seen) >= 2
    expected = {None: {LevelOutcome.RINGS, LevelOutcome.NODES}, True: {LevelOutcome.PRUNED},
                False: {LevelOutcome.PLACED}, "raised": {LevelOutcome.TOKENS}}  # fmt: skip
    # the placement the planner returned is the one marked kept, and no other
    (chosen,) = returned
    kept_at = next((i for i, placed in enumerate(made) if placed is chosen), None)
    if kept_at is None:  # the kept level placed again with the forward counted was kept
        ((factor, placed_again),) = again
        assert placed_again is chosen
        kept_at = next(i for i, t in enumerate(levels) if t.outcome is LevelOutcome.KEPT)
        assert levels[kept_at].factor == pytest.approx(factor, rel=1e-12)
    for i, (tried, (factor, outcome)) in enumerate(zip(levels, seen, strict=True)):
        assert tried.factor == pytest.approx(factor, rel=1e-12)
        assert tried.outcome in ({LevelOutcome.KEPT} if i == kept_at else expected[outcome])
    kept = levels[kept_at]
    placed = [t for t in levels if t.outcome is LevelOutcome.PLACED]
    assert all(t.busiest > kept.busiest for t in placed)
    below = sorted((t for t in levels if t.factor < kept.factor), key=lambda t: t.factor)
    failed = [t for t in below if t.outcome is LevelOutcome.RINGS]
    assert failed and below[: len(failed)] == failed  # the lowest ones
    others = {LevelOutcome.RINGS, LevelOutcome.PLACED, LevelOutcome.PRUNED}
    assert all(t.outcome in others for t in below)
    shown = summary_line(plan, plan_stats(plan, run.shape))
    low, high = min(t.factor for t in failed), max(t.factor for t in failed)
    # the lowest level's rings need more ranks than the world even perfectly shared
    # (`ring_groups.fewest_ranks`), and the summary says how many
    assert failed[0].ranks > 256
    # the kept level's rings: how many ranks they take, and how near the level their
    # members sit (group sizes come in steps)
    assert 0 < kept.ring_ranks <= 256 and 0.5 < kept.ring_fill <= 1.0
    assert (
        f"work level {kept.factor:.2f}x the mean rank's (its rings take {kept.ring_ranks} of "
        f"256 ranks, their members at {kept.ring_fill:.2f}x the level on average); lower "
        f"levels: at {low:.2f}-{high:.2f}x the rings alone need more ranks than there are (at "
        f"least {failed[0].ranks} of 256 at {low:.2f}x)"
    ) in shown
    for t in below:  # placed, but a rank ended busier than at the kept level (a level
        if t.outcome is LevelOutcome.PLACED:  # abandoned is no reason in the summary)
            assert t.busiest > kept.busiest
            assert f"at {t.factor:.2f}x a rank ended at {t.busiest:.2f}x" in shown
    record = plan_record(plan, plan_stats(plan, run.shape))["levels"]
    assert [r["outcome"] for r in record] == [t.outcome.value for t in levels]
    assert record[0]["ranks"] == failed[0].ranks and record[0]["busiest"] is None
    assert record[kept_at]["ring_ranks"] == kept.ring_ranks
    assert record[kept_at]["ring_fill"] == kept.ring_fill and record[0]["ring_fill"] is None


def test_short_sequences_place_at_the_mean_and_other_placements_have_no_levels() -> None:
    """Sequences far shorter than L balance at the first level (nothing failed below it);
    a placement made without levels (te_cp) says nothing about them."""
    run = _run(2)
    lengths = np.full(64, 1024)
    plan, _ = plan_batch(lengths, run)
    assert plan.levels[0].outcome is LevelOutcome.KEPT and plan.levels[0].factor == 1.0
    shown = summary_line(plan, plan_stats(plan, run.shape))
    assert "work level 1.00x the mean rank's" in shown and "lower levels" not in shown
    te_cp, _ = plan_batch(lengths, _run(2, "te_cp"))
    assert te_cp.levels == () and "work level" not in summary_line(
        te_cp, plan_stats(te_cp, run.shape)
    )


def test_the_sentence_names_each_reason_with_its_levels() -> None:
    """The kept level is named (not the lowest placed one), a pruned level is no reason,
    each failed one is named with its levels; without a kept level, nothing."""
    from ray_zep.partition.level_trace import LevelTry, level_sentence

    levels = (
        LevelTry(1.0, LevelOutcome.RINGS, ranks=300),
        LevelTry(1.05, LevelOutcome.NODES),
        LevelTry(1.1, LevelOutcome.TOKENS),
        LevelTry(1.2, LevelOutcome.KEPT, 1.25),
        LevelTry(1.3, LevelOutcome.PLACED, 1.3),
        LevelTry(1.15, LevelOutcome.PRUNED),
    )
    assert level_sentence(levels, 256) == (
        "work level 1.20x the mean rank's; lower levels: at 1.00x the rings alone need more "
        "ranks than there are (at least 300 of 256 at 1.00x), at 1.05x the rings across nodes "
        "find no nodes for their rests, at 1.10x the whole sequences lack token room beside "
        "the rings"
    )
    assert level_sentence(levels[-1:], 256) == ""
    assert level_sentence((), 256) == ""
    rings = LevelTry(1.2, LevelOutcome.KEPT, 1.25, ring_ranks=240, ring_fill=0.875)
    assert level_sentence((rings,), 256) == (
        "work level 1.20x the mean rank's (its rings take 240 of 256 ranks, their members at "
        "0.88x the level on average)"
    )
