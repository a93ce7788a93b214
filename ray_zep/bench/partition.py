"""`ray-zep bench partition`: planner latency and plan quality for every planner.

For each distribution, cluster size and batch size, `batches` global batches
are drawn (seeds 0, 1, ...) and placed by every planner. Reported per planner:

- planner p50 / p99: the planner's own wall time (placement and plan
  construction, without the validation pass), over all batches x repeats;
- attention FLOPs max/mean over ranks, max tokens / L, inter- and intra-node
  bytes sent (one layer, forward) and the modelled attention time of one layer
  (`ray_zep.partition.stats`), averaged over the batches;
- inter-node bytes relative to te_cp on the same batches.

L is the batch's tokens per rank times `headroom` (rounded up), so every
planner has the same slack. Distributions are the Zeppelin paper's Table 2
(arxiv, github, prolong64k) plus `short`: lengths uniform in 1..256 tokens,
thousands of sequences per batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ray_zep.command_args import (
    cluster_a_config,
    counts,
    known,
    names,
    optional_config_args,
)
from ray_zep.config import Config, ParallelConfig
from ray_zep.data.synthetic import TABLE_2, batch_lengths
from ray_zep.errors import ConfigError, ZepError
from ray_zep.model_shapes import ModelShape, build_shape
from ray_zep.parallel.axes import Placement
from ray_zep.partition import make_plan, registry
from ray_zep.partition.spec import Bench
from ray_zep.partition.stats import plan_stats
from ray_zep.report.charts import grouped_bars
from ray_zep.report.figures import save_figure
from ray_zep.report.output import BenchResult
from ray_zep.report.progress import ProgressLine
from ray_zep.report.text_table import Column
from ray_zep.topology import LinkKind, Topology, build_topology

PLANNERS = registry.listed(Bench.PARTITION)
"""Variants of the planned placements (`ray-zep simulate`'s names); the first is the one
the summary quotes."""
DISTRIBUTIONS = (*TABLE_2, "short")
SHORT_MAX_TOKENS = 256
NAME = "partition"
HELP = "planner latency and plan quality"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_case_grid_arguments(parser, "64k,128k,256k", DISTRIBUTIONS, "every planner", 5)
    parser.add_argument("--headroom", type=float, default=1.25, help="L / tokens per rank")


def add_case_grid_arguments(
    parser: argparse.ArgumentParser,
    tokens: str,
    distributions: tuple[str, ...],
    planners: str,
    repeats: int,
) -> None:
    """[CONFIG], overrides and the case flags `partition` and `layers` share."""
    optional_config_args(parser)
    parser.add_argument("--nodes", default="2,4,8", help="cluster sizes (default 2,4,8)")
    parser.add_argument("--tokens", default=tokens, help=f"tokens per batch (default {tokens})")
    parser.add_argument("--distributions", help="default: " + ",".join(distributions))
    parser.add_argument("--planners", help=f"default: {planners}")
    parser.add_argument("--batches", type=int, default=3, help="batches per case")
    parser.add_argument("--repeats", type=int, default=repeats, help="timed runs per batch")


def run(args: argparse.Namespace) -> BenchResult:
    config = cluster_a_config(args)
    grid = case_grid(args, DISTRIBUTIONS, PLANNERS)
    spec = PartitionBenchSpec(**grid, headroom=args.headroom)
    cases = len(spec.distributions) * len(spec.nodes) * len(spec.tokens)
    with ProgressLine(cases, "cases") as bar:
        rows = run_partition_bench(config, spec, bar.counter())
    return BenchResult.from_rows(
        NAME, bench_spec(spec, config), rows, COLUMNS, draw_partition_chart, key_columns=4
    )


def case_grid(
    args: argparse.Namespace, distributions: tuple[str, ...], planners: tuple[str, ...]
) -> dict[str, Any]:
    """The spec's cases from the flags `partition` and `layers` share."""
    return dict(
        nodes=counts(args.nodes, "--nodes"),
        tokens=counts(args.tokens, "--tokens"),
        distributions=names(args.distributions, distributions),
        planners=names(args.planners, planners),
        batches=args.batches,
        repeats=args.repeats,
    )


def bench_spec(spec: Any, config: Config) -> dict[str, Any]:
    """The JSON's spec: the grid and the config's presets."""
    return {**asdict(spec), "topology": config.topology.preset, "model": config.model.preset}


@dataclass(frozen=True)
class PartitionBenchSpec:
    nodes: tuple[int, ...] = (2, 4, 8)
    tokens: tuple[int, ...] = (64 * 1024, 128 * 1024, 256 * 1024)
    distributions: tuple[str, ...] = DISTRIBUTIONS
    planners: tuple[str, ...] = PLANNERS
    batches: int = 3
    repeats: int = 5
    headroom: float = 1.25
    seconds_per_planner: float = 3.0
    """Stop repeating a slow planner once one case has spent this long on it."""

    def __post_init__(self) -> None:
        known("--distributions", self.distributions, DISTRIBUTIONS)
        known("--planners", self.planners, PLANNERS)
        if min(self.nodes, default=0) < 1 or min(self.tokens, default=0) < 1:
            raise ConfigError("--nodes and --tokens need positive values")
        if self.batches < 1 or self.repeats < 1:
            raise ConfigError("--batches and --repeats must be >= 1")
        if self.headroom < 1.0:
            raise ConfigError(f"--headroom={self.headroom} must be >= 1 (L >= tokens per rank)")


@dataclass
class PartitionRow:
    distribution: str
    nodes: int
    tokens: int
    planner: str
    tokens_per_rank: int
    sequences: float = 0.0
    planner_p50_ms: float | None = None
    planner_p99_ms: float | None = None
    flops_max_over_mean: float | None = None
    max_tokens_over_l: float | None = None
    inter_node_gb: float | None = None
    intra_node_gb: float | None = None
    modelled_ms: float | None = None
    inter_vs_te_cp: float | None = None
    error: str | None = None


def synthetic_lengths(distribution: str, total: int, seed: int) -> np.ndarray:
    """A batch of exactly `total` tokens from a bench distribution."""
    if distribution != "short":
        return batch_lengths(distribution, total, seed)
    rng = np.random.default_rng([seed, 7])
    lengths = rng.integers(1, SHORT_MAX_TOKENS + 1, size=4 * total // SHORT_MAX_TOKENS + 8)
    ends = np.cumsum(lengths)
    count = int(np.searchsorted(ends, total)) + 1
    lengths = lengths[:count].copy()
    lengths[-1] -= int(ends[count - 1]) - total
    return lengths[lengths > 0]


def run_partition_bench(
    config: Config, spec: PartitionBenchSpec, progress: Callable[[str], None] | None = None
) -> list[PartitionRow]:
    """Measure every (distribution, nodes, tokens, planner) case of `spec`."""
    progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    base = build_topology(config.topology)
    shape = build_shape(config.model)
    cases = [(d, n, t) for d in spec.distributions for n in spec.nodes for t in spec.tokens]
    rows: list[PartitionRow] = []
    for index, (distribution, nodes, tokens) in enumerate(cases, start=1):
        topology = base.with_nodes(nodes)
        capacity = math.ceil(tokens / topology.world_size * spec.headroom)
        batches = [synthetic_lengths(distribution, tokens, s) for s in range(spec.batches)]
        case_rows = [
            _measure(planner, batches, topology, capacity, shape, spec) for planner in spec.planners
        ]
        for row in case_rows:
            row.distribution, row.nodes, row.tokens = distribution, nodes, tokens
        _relate_to_te_cp(case_rows)
        rows.extend(case_rows)
        headline = next((r for r in case_rows if r.planner == PLANNERS[0]), case_rows[0])
        progress(
            f"[{index}/{len(cases)}] {distribution} {nodes}x{topology.gpus_per_node} "
            f"{tokens // 1024}k tokens: {headline.planner} p50 "
            f"{_fmt(headline.planner_p50_ms)} ms"
        )
    return rows


def _measure(
    planner: str,
    batches: list[np.ndarray],
    topology: Topology,
    capacity: int,
    shape: ModelShape,
    spec: PartitionBenchSpec,
) -> PartitionRow:
    row = PartitionRow("", 0, 0, planner, capacity)
    strategy, parallel = _planner_config(planner)
    samples: list[float] = []
    quality = []
    spent = 0.0
    try:
        make_plan(strategy, batches[0], topology, capacity, shape, parallel)  # warm-up
        for lengths in batches:
            for repeat in range(spec.repeats):
                plan = make_plan(strategy, lengths, topology, capacity, shape, parallel)
                samples.append(plan.planner_seconds)
                spent += plan.planner_seconds
                if repeat and spent > spec.seconds_per_planner:
                    break
            stats = plan_stats(plan, shape)
            quality.append(
                (
                    stats.imbalance(),
                    float(stats.tokens.max()) / capacity,
                    stats.total_bytes(LinkKind.INTER_NODE) / 1e9,
                    stats.total_bytes(LinkKind.INTRA_NODE) / 1e9,
                    stats.layer_seconds * 1e3,
                    len(lengths),
                )
            )
    except ZepError as exc:
        row.error = str(exc)
        return row
    means = np.mean(np.asarray(quality), axis=0)
    row.flops_max_over_mean, row.max_tokens_over_l = float(means[0]), float(means[1])
    row.inter_node_gb, row.intra_node_gb = float(means[2]), float(means[3])
    row.modelled_ms, row.sequences = float(means[4]), float(means[5])
    row.planner_p50_ms = float(np.percentile(samples, 50) * 1e3)
    row.planner_p99_ms = float(np.percentile(samples, 99) * 1e3)
    return row


def _planner_config(planner: str) -> tuple[Placement, ParallelConfig]:
    """The placement of variant `planner` and its zone policy (the default otherwise)."""
    variant = registry.variants()[planner]
    parallel = ParallelConfig(variant.placement)
    if variant.zone_policy is not None:
        parallel = dataclasses.replace(parallel, zone_policy=variant.zone_policy)
    return variant.placement, parallel


def _relate_to_te_cp(rows: list[PartitionRow]) -> None:
    name = registry.reference().name
    reference = next((r for r in rows if r.planner == name and r.inter_node_gb), None)
    if reference is None:
        return
    for row in rows:
        if row.inter_node_gb is not None:
            row.inter_vs_te_cp = row.inter_node_gb / reference.inter_node_gb


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


COLUMNS = (
    Column("distribution", "distribution"),
    Column("nodes", "nodes"),
    Column("tokens", lambda r: f"{r.tokens // 1024}k"),
    Column("planner", "planner"),
    Column("seqs", "sequences", ".0f"),
    Column("p50 ms", "planner_p50_ms", ".2f"),
    Column("p99 ms", "planner_p99_ms", ".2f"),
    Column("flops max/mean", "flops_max_over_mean", ".2f"),
    Column("tokens/L", "max_tokens_over_l", ".2f"),
    Column("inter GB", "inter_node_gb", ".2f"),
    Column("vs te_cp", "inter_vs_te_cp", ".2f"),
    Column("model ms", "modelled_ms", ".2f"),
)


def draw_partition_chart(rows: list[PartitionRow], path: str | Path) -> Path | None:
    """Four panels at the largest cluster and batch: latency, balance, bytes, modelled time.

    Returns:
        `path`, or None when matplotlib is not installed (the picture is skipped).
    """
    panels = len(PARTITION_METRICS)
    draw = partial(_draw_partition, rows)
    return save_figure(path, draw, size=(11.0, 1.0 + 2.6 * panels), rows=panels)


PARTITION_METRICS = (
    ("planner_p50_ms", "planner latency p50", "ms"),
    ("flops_max_over_mean", "attention FLOPs imbalance", "max / mean (x)"),
    ("inter_node_gb", "inter-node bytes per layer", "GB"),
    ("modelled_ms", "modelled attention time per layer", "ms"),
)
"""(row field, panel title, y-axis label) of the partition picture's panels."""


def _draw_partition(rows: list[PartitionRow], figure: Any, axes: Any) -> None:
    nodes = max(r.nodes for r in rows)
    tokens = max(r.tokens for r in rows)
    chosen = [r for r in rows if r.nodes == nodes and r.tokens == tokens]
    distributions = list(dict.fromkeys(r.distribution for r in chosen))
    planners = list(dict.fromkeys(r.planner for r in chosen))
    by_key = {(r.distribution, r.planner): r for r in chosen}
    figure.suptitle(f"partition bench: {nodes} nodes, {tokens // 1024}k tokens per batch")
    for ax, (field, title, unit) in zip(axes[:, 0], PARTITION_METRICS, strict=True):
        values = [
            [getattr(by_key[(d, p)], field) if (d, p) in by_key else None for p in planners]
            for d in distributions
        ]
        grouped_bars(ax, distributions, planners, values, title=title, ylabel=unit)
    axes[-1, 0].set_xlabel("length distribution")
