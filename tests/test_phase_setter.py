"""Which rank ends each phase of a simulated layer, and what it holds
(`ray_zep.sim.phase_setter`), as `ray-zep simulate` reports it."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from ray_zep.config import load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.sim.events import Lane
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.phase_setter import phase_setters
from ray_zep.sim.step import RunModel, plan_batch, simulate_plan
from ray_zep.topology import build_topology

pytestmark = pytest.mark.unit


def _step(nodes: int, distribution: str):
    config = load_config(None, ["topology.preset=cluster_a", f"topology.nodes={nodes}",
                                "model.preset=7b", "train.tokens_per_rank=5120",
                                "parallel.weights=fsdp", "parallel.sequence=zeppelin"])  # fmt: skip
    run = RunModel.create(config, Hardware.preset(build_topology(config.topology)))
    lengths = batch_lengths(distribution, 4096 * 8 * nodes, seed=0)
    plan, remap = plan_batch(lengths, run)
    return simulate_plan(plan, run, config.parallel.routing, remap), plan


def test_the_rank_that_ends_each_phase_and_where_its_time_went() -> None:
    """64 GPUs of github, 7B: in each phase the rank named is one whose tasks end when
    the layer does; its compute, transfers and waits add up to the layer's makespan;
    it holds what the plan gives it, the longest sequence first, and the sentence names
    the rank and its longest sequence's tokens."""
    step, plan = _step(8, "github")
    setters = phase_setters(step)
    assert [s.phase for s in setters] == ["forward", "backward"]
    for setter, timeline in zip(setters, (step.forward, step.backward), strict=True):
        assert setter.layer_seconds == pytest.approx(timeline.makespan)
        ends = [float(timeline.end[i]) for i, t in enumerate(timeline.graph.tasks)
                if t.rank == setter.rank]  # fmt: skip
        assert max(ends) == pytest.approx(timeline.makespan, rel=1e-12)
        assert setter.compute_seconds == pytest.approx(timeline.busy(setter.rank, Lane.COMPUTE))
        parts = setter.compute_seconds + setter.transfers_seconds + setter.waits_seconds
        assert parts == pytest.approx(setter.layer_seconds, rel=1e-9)
        held = sorted((p.length for p in plan.placements if setter.rank in p.ranks), reverse=True)
        assert [h.tokens for h in setter.holds] == held
        assert held and f"rank {setter.rank} " in setter.sentence()
        assert f"{held[0]:,}-token" in setter.sentence() or setter.holds[0].ranks == 1


def test_a_step_without_timelines_or_a_plan_names_no_rank() -> None:
    """Weight-passing steps have no layer timelines, and a step kept without its plan
    (`plan --auto`'s candidates) has nothing to read: no setter, rather than a guess."""
    step, _ = _step(2, "arxiv")
    assert len(phase_setters(step)) == 2
    assert phase_setters(dataclasses.replace(step, plan=None)) == []
    assert phase_setters(dataclasses.replace(step, forward=None, backward=None)) == []


def test_simulate_reports_where_each_phase_ends(capsys, tmp_path) -> None:
    """`ray-zep simulate` prints, under its table, one line a phase for each strategy that
    placed the first batch, and its JSON record carries the same ranks."""
    from ray_zep.cli import main

    record = tmp_path / "sim.json"
    argv = ["simulate", "topology.preset=cluster_a", "topology.nodes=2", "model.preset=7b",
            "--strategies", "zeppelin,te_cp", "--tokens", "64k", "--batches", "1",
            "--json", str(record), "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "where each phase of the first batch's layer ends:" in out
    strategies = json.loads(record.read_text())["strategies"]
    for name in ("zeppelin", "te_cp"):
        setters = strategies[name]["phase_setters"]
        assert [s["phase"] for s in setters] == ["forward", "backward"]
        for setter in setters:
            assert f"  {name} {setter['phase']} ends on rank {setter['rank']} " in out
    assert np.isfinite(float(out.split("zeppelin forward ends on rank ")[1].split()[0]))
