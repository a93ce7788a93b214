"""`ray-zep simulate`: predicted step time and throughput of strategies on a cluster.

The batches, the cluster and the simulation are `ray_zep.sim.request`'s; here the
result is printed as a table and drawn: throughput bars and the first batch's
layer timelines.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ray_zep.command_args import command_line
from ray_zep.report.output import write_record
from ray_zep.report.text_table import Column, render_table
from ray_zep.report.timeline import draw_throughput, draw_timelines
from ray_zep.sim.compare import StrategyResult
from ray_zep.sim.request import SimulateResult

TIMELINE_RANKS = 16
"""Ranks drawn in the timeline picture (the first ones)."""


def _times(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}x"


STRATEGY_COLUMNS = (
    Column("strategy", "name"),
    Column("step s", "step_seconds", ".3f"),
    Column("k tok/s", "tokens_per_second", ".1f", scale=1e3),
    Column("vs te_cp", lambda row: _times(row["speedup"])),
    Column("x ideal", lambda row: _times(row["over_ideal"])),
    Column("x bound", lambda row: _times(row["over_bound"])),
    Column("imbalance s", "imbalance", ".3f"),
    Column("split kernels s", "split kernels", ".3f"),
    Column("contention s", "contention", ".3f"),
    Column("transfers s", "exposed transfers", ".3f"),
    Column("waits s", "waits", ".3f"),
    Column("recompute s", "recompute", ".3f"),
    Column("GPU busy", "gpu_busy", ".2f"),
    Column("fwd ms/layer", "forward_ms", ".2f"),
    Column("bwd ms/layer", "backward_ms", ".2f"),
    Column("grad s", "grad_seconds", ".3f"),
    Column("remap", "remapped"),
)


def result_table(result: SimulateResult) -> str:
    """A line on the setup, one row per strategy, then the ideal step."""
    topology = result.topology
    lines = [
        f"{topology.name}: {topology.nodes} x {topology.gpus_per_node} "
        f"{topology.gpu_model}, model {result.config.model.preset}, "
        f"{len(result.batches)} batches of {int(np.mean([b.sum() for b in result.batches]))} "
        f"tokens, L={result.tokens_per_rank}; rates: {result.rates.source}",
    ]
    rows = [_strategy_row(result, name, strategy) for name, strategy in result.results.items()]
    lines.append(render_table(rows, STRATEGY_COLUMNS, key_columns=1))
    if result.ideal_seconds:
        lines.append(
            f"ideal step {np.mean(result.ideal_seconds):.3f} s: every FLOP spread evenly at "
            "its unsplit rate, no exposed communication (x ideal: step / ideal, per batch)"
        )
    if result.bounds:
        largest = sorted({b.largest for b in result.bounds})
        lines.append(
            f"bound {np.mean([b.seconds for b in result.bounds]):.3f} s: in the forward and "
            "in the backward, whichever is larger of the ideal compute (with the least the "
            "weights' collectives slow its linear modules), the K/V exchange no "
            "placement avoids, the weights' collectives and both on one node's NICs, the "
            "two phases added, plus what no compute hides (largest part: "
            f"{'; '.join(largest)}); "
            "imbalance, split kernels, contention, exposed transfers, "
            "waits and what checkpointing recomputes split the step beyond it"
        )
    lines.append(
        "GPU busy: the share of every rank's layer time spent computing (the JSON record's "
        "gpu_time_shares split the rest: waiting for the slowest rank, idle in a ring, other)"
    )
    setters = [
        f"  {name} {setter.sentence()}"
        for name, strategy in result.results.items()
        for setter in result.phase_setters(strategy)
    ]
    if setters:
        lines += ["where each phase of the first batch's layer ends:", *setters]
    return "\n".join(lines)


def _strategy_row(result: SimulateResult, name: str, strategy: StrategyResult) -> dict:
    if strategy.error:
        return {"name": name, "error": f"cannot place: {strategy.error}"}
    steps = strategy.steps
    return {
        "name": name,
        "step_seconds": strategy.step_seconds,
        "tokens_per_second": strategy.tokens_per_second,
        "speedup": strategy.speedup_vs_te_cp,
        "over_ideal": result.over_ideal(strategy),
        "over_bound": result.over_bound(strategy),
        **(result.beyond_bound(strategy) or {}),
        "gpu_busy": (result.gpu_time(strategy) or {}).get("computing"),
        "forward_ms": float(np.mean([s.forward_layer_seconds for s in steps]) * 1e3),
        "backward_ms": float(np.mean([s.backward_layer_seconds for s in steps]) * 1e3),
        "grad_seconds": steps[0].grad_sync_seconds,
        "remapped": f"{sum(s.remap is not None for s in steps)}/{len(steps)}",
    }


def write_outputs(result: SimulateResult, json_path: str | None, out_dir: str) -> list[Path]:
    """JSON record (when asked), throughput bars and the first batch's layer timelines."""
    written = []
    if json_path:
        command = command_line("ray-zep simulate")
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
