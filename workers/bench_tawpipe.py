"""`ray-zep bench tawpipe`: the weight-passing modes simulated on TawPipe's testbed
(`ray_zep.bench.tawpipe`), then, unless `--cpu-steps 0`, the executor's modes trained
for real on the CPU virtual cluster through Ray (`ray_zep_workers.bench_train`). The record
keeps the simulated rows and the CPU runs' rows apart (`rows`, `cpu`).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from ray_zep.bench import tawpipe
from ray_zep.command_args import counts, positive
from ray_zep.errors import ConfigError
from ray_zep.parallel.axes import WeightsMode
from ray_zep.report.output import BenchResult
from ray_zep.report.text_table import render_table

NAME = WeightsMode.TAWPIPE.value
HELP = "weight-passing modes on TawPipe's testbed"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", default="1024,2048,4096", help="model dims H")
    parser.add_argument("--seq-lens", default="4k,8k,16k", help="sequence lengths")
    parser.add_argument(
        "--nic-gbps", type=float, default=10.0, help="line rate between nodes, Gb/s (10)"
    )
    parser.add_argument("--cpu-config", default="conf/demo.yaml", help="config of the CPU runs")
    parser.add_argument("--cpu-steps", type=int, default=6, help="steps of each CPU run (0: none)")


def run(args: argparse.Namespace) -> BenchResult:
    nic_gbps = positive("--nic-gbps", args.nic_gbps)
    if args.cpu_steps == 1 or args.cpu_steps < 0:
        raise ConfigError(f"--cpu-steps={args.cpu_steps}: 0 (no CPU runs) or >= 2 (one warm-up)")
    spec = tawpipe.TawPipeBenchSpec(
        hidden_sizes(args.hidden), counts(args.seq_lens, "--seq-lens"), nic_gbps=nic_gbps
    )
    rows = tawpipe.simulate_rows(spec)
    footer, record = tawpipe.footer(rows), {}
    if args.cpu_steps:
        cpu_lines, record["cpu"] = cpu_runs(args.cpu_config, args.cpu_steps, Path(args.out))
        footer += ["", *cpu_lines]
    return BenchResult.from_rows(
        NAME,
        asdict(spec),
        rows,
        tawpipe.COLUMNS,
        tawpipe.draw_tawpipe_chart,
        notes=[f"simulated on {spec.cluster().source}"],
        footer=footer,
        goals=tawpipe.goals(rows),
        record=record,
    )


def hidden_sizes(text: str) -> tuple[int, ...]:
    """`--hidden`: model dims, each a positive multiple of 128 (the heads' dim)."""
    items = text.split(",")
    for item in items:
        if not item.isdigit() or int(item) % 128 or int(item) == 0:
            raise ConfigError(f"--hidden item {item!r} must be a positive multiple of 128")
    return tuple(int(h) for h in items)


def cpu_runs(config: str, steps: int, out: Path) -> tuple[list[str], list[dict]]:
    """(the lines of their table, their rows) of the executor's modes trained `steps`
    steps each from `config` on the CPU virtual cluster, in OUT/cpu."""
    from ray_zep_workers import bench_train  # trains through Ray, like `bench train`

    modes = tuple(m.value for m in tawpipe.MODES)
    rows, _ = bench_train.run_train_bench(config, [], modes, steps, out / "cpu")
    title = f"real CPU runs ({config}, {steps} steps each):"
    return [title, render_table(rows, bench_train.COLUMNS)], bench_train.row_dicts(rows)
