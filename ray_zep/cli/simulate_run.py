"""`ray-zep simulate`: predicted step time and throughput of strategies on a cluster.

The batches, the cluster and the simulation are `ray_zep.sim.request`'s; here the
result is printed as a table and drawn: throughput bars and the first batch's
layer timelines.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ray_zep.report.output import write_record
from ray_zep.report.timeline import draw_throughput, draw_timelines
from ray_zep.sim.request import SimulateResult

TIMELINE_RANKS = 16
"""Ranks drawn in the timeline picture (the first ones)."""


def result_table(result: SimulateResult) -> str:
    """A line on the setup, one line per strategy, then the ideal step."""
    topology = result.topology
    lines = [
        f"{topology.name}: {topology.nodes} x {topology.gpus_per_node} "
        f"{topology.gpu_model}, model {result.config.model.preset}, "
        f"{len(result.batches)} batches of {int(np.mean([b.sum() for b in result.batches]))} "
        f"tokens, L={result.tokens_per_rank}; rates: {result.rates.source}",
        f"{'strategy':<26}{'step s':>9}{'k tok/s':>10}{'vs te_cp':>10}{'x ideal':>9}"
        f"{'fwd ms/layer':>14}{'bwd ms/layer':>14}{'grad s':>8}{'remap':>7}",
    ]
    for name, strategy in result.results.items():
        if strategy.error:
            lines.append(f"{name:<26}  cannot place: {strategy.error}")
            continue
        steps = strategy.steps
        fwd = np.mean([s.forward_layer_seconds for s in steps]) * 1e3
        bwd = np.mean([s.backward_layer_seconds for s in steps]) * 1e3
        remapped = sum(s.remap is not None for s in steps)
        over = result.over_ideal(strategy)
        lines.append(
            f"{name:<26}{strategy.step_seconds:>9.3f}{strategy.tokens_per_second / 1e3:>10.1f}"
            f"{strategy.speedup_vs_te_cp:>9.2f}x{over or float('nan'):>8.2f}x{fwd:>14.2f}"
            f"{bwd:>14.2f}{steps[0].grad_sync_seconds:>8.3f}{remapped:>5}/{len(steps)}"
        )
    if result.ideal_seconds:
        lines.append(
            f"ideal step {np.mean(result.ideal_seconds):.3f} s: every FLOP spread evenly at "
            "its unsplit rate, no exposed communication (x ideal: step / ideal, per batch)"
        )
    return "\n".join(lines)


def write_outputs(result: SimulateResult, json_path: str | None, out_dir: str) -> list[Path]:
    """JSON record (when asked), throughput bars and the first batch's layer timelines."""
    written = []
    command = "ray-zep " + " ".join(sys.argv[1:]) if sys.argv[1:] else "ray-zep simulate"
    if json_path:
        written.append(write_record(Path(json_path), command, result.record()))
    out = Path(out_dir)
    placed = {n: r for n, r in result.results.items() if r.steps}
    title = f"{result.config.model.preset} on {result.topology.world_size} GPUs"
    speeds = [r.tokens_per_second for r in placed.values()]
    pictures = [draw_throughput(title, list(placed), speeds, out / "throughput.png")]
    panels = []
    for name, r in placed.items():
        panels += [
            (f"{name} forward", r.steps[0].forward),
            (f"{name} backward", r.steps[0].backward),
        ]
    ranks = range(min(TIMELINE_RANKS, result.topology.world_size))
    pictures.append(draw_timelines(panels, list(ranks), out / "timeline.png"))
    return written + [p for p in pictures if p is not None]  # None: no matplotlib, logged
