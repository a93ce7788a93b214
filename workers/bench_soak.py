"""`ray-zep bench soak`: a long run of the demo composition, and whether it stays flat.

It trains CONFIG (the demo by default) for `--steps` steps through the Ray driver, as
`ray-zep train` does, into OUT/run (a fresh run), then reads its metrics.jsonl back:
the resident memory and open file descriptors of the driver, the data actor and every
rank, and the step time, after the warm-up against the end of the run
(`ray_zep.bench.soak`). The run keeps its two newest checkpoints (`SOAK_OVERRIDES`,
so its disk use stays flat too; a later override wins).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from ray_zep import command_args, steplog
from ray_zep.bench.soak import (
    FD_SLACK,
    RSS_GROWTH_GOAL,
    STEP_DRIFT_GOAL,
    SoakReport,
    draw_soak,
    soak_report,
)
from ray_zep.config import load_config
from ray_zep.constants import METRICS_FILE_NAME
from ray_zep.report.output import BenchResult
from ray_zep.report.text_table import Column
from ray_zep_workers.steady_state import TIMING_OVERRIDES

NAME = "soak"
HELP = "a long run: memory, descriptors and step time per process"
SOAK_OVERRIDES = ("train.keep_checkpoints=2", *TIMING_OVERRIDES)
COLUMNS = [
    Column("process", "process"),
    Column("MiB after warm-up", "rss_start", ".1f", 2**20),
    Column("MiB at end", "rss_end", ".1f", 2**20),
    Column("growth", "rss_growth", "+.1%"),
    Column("fds after warm-up", "fds_start", ".0f"),
    Column("fds at end", "fds_end", ".0f"),
    Column("flat", lambda p: "yes" if p.flat else "NO"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default="conf/demo.yaml", help="YAML config")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument("--steps", type=int, default=2000, help="steps to train")
    parser.add_argument(
        "--warm-up", type=int, help="steps before the comparison starts (default: a tenth)"
    )


def run(args: argparse.Namespace) -> BenchResult:
    from ray_zep_workers.driver import train  # Ray only for this bench

    command_args.at_least("--steps", args.steps, 30, "a warm-up and two windows of 10")
    warm_up = args.steps // 10 if args.warm_up is None else args.warm_up
    command_args.at_least("--warm-up", warm_up, 0, "steps")
    command_args.at_least("--steps", args.steps, warm_up + 20, "--warm-up, then two windows of 10")
    run_dir = Path(args.out).resolve() / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resume
    overrides = [*SOAK_OVERRIDES, *args.overrides, f"train.steps={args.steps}",
                 f"train.out_dir={run_dir}"]  # fmt: skip
    summary = train(load_config(args.config, overrides))
    rows = steplog.step_rows(run_dir / METRICS_FILE_NAME)
    report = soak_report(rows, warm_up)
    spec = {"config": args.config, "overrides": overrides, "steps": args.steps}
    spec["warm_up"] = warm_up
    return BenchResult.from_rows(
        NAME,
        spec,
        report.processes,
        COLUMNS,
        records=[_row(p) for p in report.processes],
        notes=[f"{len(rows)} steps, {summary.restarts} restart(s); windows of {report.window} "
               f"steps after the warm-up of {warm_up} and at the end, by their medians"],
        footer=[_step_line(report), f"run directory: {_du(run_dir) / 2**20:.0f} MiB at the end"],
        goals=_goals(report),
        record={"step_seconds": _step_record(report)},
        draw=lambda path: draw_soak(path, rows, report),
    )  # fmt: skip


def _row(process) -> dict:
    return {**process.__dict__, "rss_growth": process.rss_growth, "flat": process.flat}


def _step_line(report: SoakReport) -> str:
    return (
        f"step time: {report.step_start * 1e3:.1f} ms after the warm-up, "
        f"{report.step_end * 1e3:.1f} ms at the end ({report.step_drift:+.1%}); fitted line "
        f"{report.step_fit_drift:+.1%} over the run; spread (IQR / median) {report.step_noise:.1%}"
    )


def _step_record(report: SoakReport) -> dict:
    return {
        "start": report.step_start,
        "end": report.step_end,
        "drift": report.step_drift,
        "fit_drift": report.step_fit_drift,
        "noise": report.step_noise,
    }


def _goals(report: SoakReport) -> list[tuple[str, bool]]:
    grown = [p.process for p in report.processes if not p.flat]
    return [
        (
            f"every process within {RSS_GROWTH_GOAL:.0%} resident memory and {FD_SLACK} "
            f"descriptors of its size after the warm-up (not: {', '.join(grown) or 'none'})",
            not grown,
        ),
        (f"step time within {STEP_DRIFT_GOAL:.0%} of after the warm-up", report.step_flat),
    ]


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
