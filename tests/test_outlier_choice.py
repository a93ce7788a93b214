"""`plan --auto` plays outlier delay (`ray_zep.sim.outlier_choice`): the thresholds it
tries, the window that compares it, and the candidate it ranks."""

from __future__ import annotations

import numpy as np
import pytest

from ray_zep.config import load_config
from ray_zep.sim.outlier_choice import MIN_WINDOW, delay_window, delayed, thresholds

pytestmark = pytest.mark.unit

# 4 nodes x 2 GPUs, L = 1,000: a node holds 2,000 tokens, a batch 6,400 (fill 0.8); the
# chat mix scaled down holds a few documents of 4,000+ tokens (two nodes' room)
SMALL = ["topology.nodes=4", "topology.gpus_per_node=2", "train.tokens_per_rank=1000",
         "data.source=synthetic:chat", "data.length_scale=0.05", "parallel.sequence=zeppelin",
         "data.packing=budget", "data.batch_fill=0.8"]  # fmt: skip


def test_thresholds_are_node_spans_the_batches_hold_enough_documents_of() -> None:
    config = load_config(None, SMALL)
    # 2 nodes' room: 4,000 tokens; in 4 batches the rarer threshold is the 2nd longest
    lengths = [np.array([100, 4000, 300]), np.array([4500, 9000, 20]), np.array([50]),
               np.array([60])]  # fmt: skip
    assert thresholds(config, 2, lengths) == [4000, 4500]
    # in 2 batches the longest: but one document of 4,100 has nothing to pair with
    assert thresholds(config, 2, [np.array([100, 4000, 300]), np.array([4100])]) == [4000]
    assert thresholds(config, 2, [np.array([4000, 300])]) == []  # one: nothing to pair it with
    assert thresholds(config, 2, [np.array([3000, 3500]), np.array([100])]) == []  # none spans 2
    set_already = load_config(None, [*SMALL, "data.outlier_tokens=3000"])
    assert thresholds(set_already, 2, lengths) == []  # the config's own delay stands
    ranked = load_config(None, [*SMALL[:4], "parallel.sequence=te_cp", "data.packing=rank"])
    assert thresholds(ranked, 2, lengths) == []


def test_the_delay_window_ends_with_no_outlier_held_and_trains_what_it_held() -> None:
    """The window is the delayed stream's first batches, extended until nothing is held:
    every document it met is trained in it, as many tokens as the plain stream's first
    documents (to the piece cut at the end)."""
    from ray_zep.sim.replay import data_batches

    trial = delayed(load_config(None, SMALL), 4000)
    window, held = delay_window(trial, 8, 4)
    assert held == 0 and len(window) >= 4
    drawn = data_batches(trial, 8, 0, len(window))  # the same stream, batch for batch
    assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(window, drawn, strict=True))
    plain = data_batches(load_config(None, SMALL), 8, 0, len(window))
    ours, theirs = sum(int(a.sum()) for a, _ in window), sum(int(a.sum()) for a, _ in plain)
    assert abs(ours - theirs) <= 6400  # about the same documents, at most one batch apart
    assert any((a >= 4000).any() for a, _ in window)
    with pytest.raises(Exception, match="outlier_tokens"):
        delay_window(load_config(None, SMALL), 8, 4)


def test_plan_auto_ranks_the_delay_at_the_composition_s_step_times_its_ratio(tmp_path) -> None:
    """The fastest budget-packed composition is played with the delay on its window
    beside itself without it on as many batches; the delay's candidate is named for its
    threshold, steps the composition's step times the seconds-per-token ratio of the two
    windows, and its YAML trains with the delay."""
    from ray_zep.sim.auto import AutoPlan, delayed_candidates, evaluate_group, write_best
    from ray_zep.sim.replay import data_batches
    from ray_zep.sim.request import request_hardware

    config = load_config(None, SMALL)
    hardware, on_gpu = request_hardware(config, None)

    def data_of(candidate, count):
        return data_batches(candidate, hardware.devices, 0, count)

    searched = evaluate_group([config], hardware, data_of(config, 3), on_gpu)
    (candidate,) = delayed_candidates(AutoPlan(searched), config, hardware, data_of, on_gpu)
    delay = candidate.delay
    assert candidate.name.endswith("+outlier_tokens=4000") and candidate.delay_of is searched[0]
    assert delay.threshold == 4000 and delay.batches >= MIN_WINDOW and delay.held_at_end == 0
    assert len(candidate.steps) == delay.batches
    drawn = data_of(candidate.config, delay.batches)  # the delayed window, drawn again
    assert delay.outliers == sum(int((a >= 4000).sum()) for a, _ in drawn) >= 2
    (plain,) = evaluate_group([config], hardware, data_of(config, delay.batches), on_gpu)
    assert delay.plain_tokens_per_second == pytest.approx(plain.tokens_per_second)
    window = sum(s.tokens for s in candidate.steps) / sum(s.step_seconds for s in candidate.steps)
    assert delay.delayed_tokens_per_second == pytest.approx(window)
    ratio = plain.tokens_per_second / window
    assert delay.ratio == pytest.approx(ratio) and delay.ratio != pytest.approx(1.0)
    assert candidate.step_seconds == pytest.approx(searched[0].step_seconds * ratio)
    assert candidate.tokens_per_second == pytest.approx(searched[0].tokens_per_second / ratio)
    plan = AutoPlan([candidate])
    assert f"with data.outlier_tokens = 4000 it trains {window:,.0f}" in plan.why()
    assert load_config(write_best(plan, tmp_path / "best.yaml"), []).data.outlier_tokens == 4000
    sampled = delayed_candidates(AutoPlan(searched), config, hardware, data_of, on_gpu, 0)
    assert [c.name for c in sampled] == [candidate.name]  # a window of at least MIN_WINDOW


def test_plan_summary_names_an_outlier_on_the_busiest_rank() -> None:
    """256 GPUs of cluster A, 7B, L = 5,120: on the chat mix the busiest rank works on the
    242,302-token document's group, and `ray-zep plan`'s summary says it is an outlier and
    what may help; on arxiv (no document spans two nodes) it says nothing of the kind."""
    from ray_zep.report.placement import outlier_on_busiest
    from tests.helpers.summaries import summaries

    planned = summaries(["parallel.sequence=zeppelin"], ("chat", "arxiv"))
    found = {data: outlier_on_busiest(plan, stats) for data, (plan, stats, _) in planned.items()}
    for data, (_, _, line) in planned.items():
        assert ("an outlier whose group may set the step" in line) == (found[data] is not None)
    rank, length, nodes = found["chat"]
    assert length == 242_302 and nodes >= 2 and found["arxiv"] is None
    plan = planned["chat"][0]
    assert rank in plan.placement(int(np.argmax(plan.lengths == length))).ranks


def test_bench_outliers_writes_table_json_and_png(tmp_path, capsys) -> None:
    """`ray-zep bench outliers` on 32 GPUs of arxiv (L = 1,280): a row per threshold with
    both windows' tokens/s on the same number of batches, the window ending with nothing
    held, and the JSON and PNG written."""
    import json

    from ray_zep.cli import main

    out = tmp_path / "bench"
    argv = ["bench", "outliers", "--gpus", "32", "--data", "arxiv", "--tokens", "1024",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    record = json.loads((out / "outliers.json").read_text())
    (row,) = record["rows"]
    assert row["threshold"] == 2 * 8 * 1280 and row["batches"] >= MIN_WINDOW
    assert row["held_at_end"] == 0 and row["outliers"] >= 2
    assert row["plain_tokens_per_s_per_gpu"] > 0 and row["delayed_tokens_per_s_per_gpu"] > 0
    assert (out / "outliers.png").exists() and "tok/s/GPU delayed" in capsys.readouterr().out


def test_a_delay_whose_window_still_holds_outliers_is_not_ranked(monkeypatch) -> None:
    """Where the delayed stream's window ends with outliers still held, their cost would
    be left out of the comparison: the candidate keeps its figures but no steps, says why,
    and cannot win."""
    from ray_zep.sim import auto
    from ray_zep.sim.replay import data_batches
    from ray_zep.sim.request import request_hardware

    config = load_config(None, SMALL)
    hardware, on_gpu = request_hardware(config, None)

    def data_of(candidate, count):
        return data_batches(candidate, hardware.devices, 0, count)

    real = auto.delay_window
    monkeypatch.setattr(auto, "delay_window", lambda *a: (real(*a)[0], 2))
    searched = auto.evaluate_group([config], hardware, data_of(config, 3), on_gpu)
    (held,) = auto.delayed_candidates(auto.AutoPlan(searched), config, hardware, data_of, on_gpu)
    assert held.delay.held_at_end == 2 and not held.steps and "2 outliers still held" in held.error
    assert auto.AutoPlan([*searched, held]).best is searched[0]


def test_plan_auto_on_the_configured_data_plays_the_delay(tmp_path, monkeypatch, capsys) -> None:
    """`ray-zep plan --auto` without `--distribution` hands the data's stream to the delay's
    pass (one composition searched here, to keep it short): the ranking holds the delayed
    candidate with its ratio; with `--distribution` there is no stream and no delay. The
    token room is left out too, so that the delay plays the configured L."""
    import json

    from ray_zep.cli import main
    from ray_zep.sim import auto

    monkeypatch.setattr(auto, "compositions", lambda config, world: [config])
    monkeypatch.setattr(auto, "_roomier", lambda *args: [])
    for extra, delays in (([], 1), (["--distribution", "chat", "--tokens", "8k"], 0)):
        ranking = tmp_path / f"ranking{len(extra)}.json"
        argv = ["plan", "--auto", *SMALL, "--batches", "2", "--json", str(ranking), *extra]
        assert main(argv) == 0
        rows = json.loads(ranking.read_text())
        delayed_rows = [r for r in rows if "+outlier_tokens=" in r["composition"]]
        assert len(delayed_rows) == delays, rows
        assert all(r["outlier_delay_ratio"] > 0 for r in delayed_rows)
    assert "chosen:" in capsys.readouterr().out


def test_plan_auto_ranks_compositions_that_cut_documents_after_those_that_do_not(
    monkeypatch, capsys
) -> None:
    """On the configured data, rank-packed whole sequences cut every document longer than
    L into pieces the config's budget-packed batches train whole: however fast, they rank
    after the compositions that train the documents whole, marked in the table."""
    import dataclasses

    from ray_zep.cli import main
    from ray_zep.config import Packing
    from ray_zep.parallel.axes import Placement
    from ray_zep.sim import auto

    def two(config, world):
        whole = dataclasses.replace(config.parallel, sequence=Placement.WHOLE)
        data = dataclasses.replace(config.data, packing=Packing.RANK, batch_fill=1.0)
        return [config, dataclasses.replace(config, parallel=whole, data=data)]

    monkeypatch.setattr(auto, "compositions", two)
    chosen = {}
    monkeypatch.setattr(auto, "write_best", lambda plan, path: chosen.setdefault("plan", plan))
    assert main(["plan", "--auto", *SMALL, "--batches", "2", "--out", "unused.yaml"]) == 0
    plan = chosen["plan"]
    cut = [c for c in plan.candidates if c.config.parallel.sequence is Placement.WHOLE]
    assert [c.cut_at for c in cut] == [1000] and cut[0].steps
    whole_docs = [c for c in plan.ranked if c.steps and c.cut_at is None]
    assert plan.ranked.index(cut[0]) == len(whole_docs) and plan.best is whole_docs[0]
    assert "cut at 1,000" in capsys.readouterr().out
