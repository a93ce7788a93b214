"""`ray-zep bench layers`: what the routing and remapping layers do to real plans.

For each distribution, cluster size and batch size, `batches` global batches
are placed by each planner. Reported per planner, averaged over the batches:

- busiest NIC, MB of one layer (forward + backward, bf16 K/V, fp32 dK/dV)
  without and with routing, and their ratio; intra-node MB with routing
  (dispatch and combine hops add to the direct intra-node hops);
- remap: tokens moved (share of the batch), the solver's max per-rank cost and
  its wall time p50 / p99 over batches x repeats.

Byte counts come from the same transfer lists the engine executes
(`ray_zep.traffic`), not from a separate model.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ray_zep.bench.partition import (
    add_case_grid_arguments,
    bench_spec,
    case_grid,
    synthetic_lengths,
)
from ray_zep.command_args import cluster_a_config, known
from ray_zep.config import Config
from ray_zep.data.synthetic import TABLE_2
from ray_zep.errors import ConfigError, ZepError
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import Placement
from ray_zep.partition import make_plan, registry
from ray_zep.partition.spec import Bench
from ray_zep.remap.solver import remap_token_bytes, solve_remap
from ray_zep.report.charts import grouped_bars
from ray_zep.report.figures import save_figure
from ray_zep.report.output import BenchResult
from ray_zep.report.progress import ProgressLine
from ray_zep.report.text_table import Column
from ray_zep.topology import build_topology
from ray_zep.traffic import collective_traffic, ring_traffic

PLANNERS = registry.listed(Bench.LAYERS)
NAME = "layers"
HELP = "routing (NIC bytes) and remap (solver) on plans"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_case_grid_arguments(parser, "256k", tuple(TABLE_2), ",".join(PLANNERS), 20)


def run(args: argparse.Namespace) -> BenchResult:
    config = cluster_a_config(args)
    spec = LayersBenchSpec(**case_grid(args, tuple(TABLE_2), PLANNERS))
    cases = len(spec.distributions) * len(spec.nodes) * len(spec.tokens)
    with ProgressLine(cases, "cases") as bar:
        rows = run_layers_bench(config, spec, bar.counter())
    return BenchResult.from_rows(
        NAME, bench_spec(spec, config), rows, COLUMNS, draw_layers_chart, key_columns=4
    )


@dataclass(frozen=True)
class LayersBenchSpec:
    nodes: tuple[int, ...] = (2, 4, 8)
    tokens: tuple[int, ...] = (256 * 1024,)
    distributions: tuple[str, ...] = tuple(TABLE_2)
    planners: tuple[str, ...] = PLANNERS
    batches: int = 3
    repeats: int = 20
    headroom: float = 1.25

    def __post_init__(self) -> None:
        known("--distributions", self.distributions, TABLE_2)
        known("--planners", self.planners, PLANNERS)
        if min(self.nodes, default=0) < 1 or min(self.tokens, default=0) < 1:
            raise ConfigError("--nodes and --tokens need positive values")
        if self.batches < 1 or self.repeats < 1 or self.headroom < 1.0:
            raise ConfigError("--batches and --repeats must be >= 1, --headroom >= 1")


@dataclass
class LayersRow:
    distribution: str
    nodes: int
    tokens: int
    planner: str
    busiest_nic_direct_mb: float | None = None
    busiest_nic_routed_mb: float | None = None
    busiest_ratio: float | None = None
    intra_direct_mb: float | None = None
    intra_routed_mb: float | None = None
    remap_moved_share: float | None = None
    remap_cost_us: float | None = None
    solve_p50_ms: float | None = None
    solve_p99_ms: float | None = None
    error: str | None = None


def run_layers_bench(
    config: Config, spec: LayersBenchSpec, progress: Callable[[str], None] | None = None
) -> list[LayersRow]:
    progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    base, shape = build_topology(config.topology), build_shape(config.model)
    rows = []
    cases = [(d, n, t) for d in spec.distributions for n in spec.nodes for t in spec.tokens]
    for index, (distribution, nodes, tokens) in enumerate(cases, start=1):
        topology = base.with_nodes(nodes)
        capacity = math.ceil(tokens / topology.world_size * spec.headroom)
        batches = [synthetic_lengths(distribution, tokens, s) for s in range(spec.batches)]
        for planner in spec.planners:
            row = LayersRow(distribution, nodes, tokens, planner)
            try:
                _measure(row, batches, topology, capacity, shape, config, spec)
            except ZepError as exc:
                row.error = str(exc)
            rows.append(row)
        progress(f"[{index}/{len(cases)}] {distribution} {nodes} nodes {tokens} tokens")
    return rows


def _measure(row, batches, topology, capacity, shape, config, spec) -> None:
    samples: dict[str, list[float]] = {}
    times = []
    for lengths in batches:
        plan = make_plan(
            Placement(row.planner), lengths, topology, capacity, shape, config.parallel
        )
        others = collective_traffic(plan, shape)
        direct = ring_traffic(plan, shape, routed=False) + others
        routed = ring_traffic(plan, shape, routed=True) + others
        counts = plan.rank_tokens()
        for _ in range(spec.repeats):
            started = time.perf_counter()
            remap = solve_remap(counts, topology, remap_token_bytes(shape))
            times.append(time.perf_counter() - started)
        for key, value in (
            ("direct", direct.nic.max() / 1e6),
            ("routed", routed.nic.max() / 1e6),
            ("intra_direct", direct.intra_node / 1e6),
            ("intra_routed", routed.intra_node / 1e6),
            ("moved", remap.moved_tokens() / max(1, int(counts.sum()))),
            ("cost", remap.max_rank_cost * 1e6),
        ):
            samples.setdefault(key, []).append(float(value))
    mean = {k: float(np.mean(v)) for k, v in samples.items()}
    row.busiest_nic_direct_mb, row.busiest_nic_routed_mb = mean["direct"], mean["routed"]
    row.busiest_ratio = mean["routed"] / mean["direct"] if mean["direct"] else None
    row.intra_direct_mb, row.intra_routed_mb = mean["intra_direct"], mean["intra_routed"]
    row.remap_moved_share, row.remap_cost_us = mean["moved"], mean["cost"]
    row.solve_p50_ms = float(np.percentile(times, 50) * 1e3)
    row.solve_p99_ms = float(np.percentile(times, 99) * 1e3)


COLUMNS = (
    Column("dist", "distribution"),
    Column("nodes", "nodes"),
    Column("tokens", "tokens"),
    Column("planner", "planner"),
    Column("NIC MB", "busiest_nic_direct_mb", ".1f"),
    Column("NIC routed", "busiest_nic_routed_mb", ".1f"),
    Column("ratio", "busiest_ratio", ".2f"),
    Column("intra MB", "intra_direct_mb", ".1f"),
    Column("intra routed", "intra_routed_mb", ".1f"),
    Column("moved", "remap_moved_share", ".3f"),
    Column("cost us", "remap_cost_us", ".1f"),
    Column("p50 ms", "solve_p50_ms", ".2f"),
    Column("p99 ms", "solve_p99_ms", ".2f"),
)


def draw_layers_chart(rows: list[LayersRow], path: Path) -> Path | None:
    """Busiest-NIC ratio (routed / direct) and solve p50 per planner, at the largest size.

    Returns:
        `path`, or None when matplotlib is not installed (the picture is skipped).
    """
    return save_figure(path, partial(_draw_layers, rows), size=(10.0, 6.6), rows=2)


def _draw_layers(rows: list[LayersRow], figure: Any, axes: Any) -> None:
    nodes, tokens = max(r.nodes for r in rows), max(r.tokens for r in rows)
    chosen = [r for r in rows if r.nodes == nodes and r.tokens == tokens]
    dists = list(dict.fromkeys(r.distribution for r in chosen))
    planners = list(dict.fromkeys(r.planner for r in chosen))

    def grid(field):
        table = {(r.distribution, r.planner): getattr(r, field) for r in chosen}
        return [[table.get((d, p)) for p in planners] for d in dists]

    figure.suptitle(f"routing and remap, {nodes} nodes, {tokens} tokens per batch")
    title = "busiest NIC bytes, routed / direct"
    ratio, solve = grid("busiest_ratio"), grid("solve_p50_ms")
    grouped_bars(axes[0, 0], dists, planners, ratio, title=title, ylabel="routed / direct (x)")
    title, xlabel = "remap solve time p50", "length distribution"
    grouped_bars(axes[1, 0], dists, planners, solve, title=title, ylabel="ms", xlabel=xlabel)
