"""`ray-zep bench validate`: the simulator against what runs, in one command.

1. calibrates this machine (`ray-zep bench calibrate`: kernels, the virtual
   cluster's links, the trainer's fixed step cost);
2. trains every sequence placement with replicated weights and with FSDP2 on the
   configured virtual cluster (`ray-zep bench train`'s runs; `--quick`: a subset,
   and a calibration on one pair of job runs and one round of link measurements,
   `QUICK_JOB_RUNS`, `QUICK_LINK_ROUNDS`; `--sittings N`: each mode N times, in passes
   over the modes, its row over all its runs, `ray_zep_workers.bench_train.combine_sittings`);
3. replays the same batches through the simulator on the calibration, with each
   run's share of the cores probed around it (`ray_zep.core_share`);
4. simulates the papers' headline setups (`ray_zep.bench.headlines`).

Rows: `{"kind": "cpu", "mode", "predicted_tokens_per_s", "measured_tokens_per_s",
"predicted_over_measured", "core_share", "measured_error", "probed_shares"}` per mode,
`{"kind": "auto", "chosen", "fastest_measured", "chosen_over_fastest"}` (the mode the
simulator ranks first, as `plan --auto` ranks, against the fastest measured), `{"kind":
"ranking", "pairs", "resolved_pairs", "swapped_resolved", "swapped_unresolved"}` (the
pairs of modes the prediction orders the other way round than the measurement, apart
for the pairs whose measured order the runs' own spread leaves open: step to step, and
with sittings also run to run) and
`{"kind": "paper", "name", "paper", "simulated", "explained"}` per headline.
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from ray_zep.bench.calibrate_links import ROUNDS as LINK_ROUNDS
from ray_zep.bench.headlines import PaperRow, paper_rows
from ray_zep.command_args import at_least
from ray_zep.parallel.axes import WeightsMode
from ray_zep.partition import registry
from ray_zep.partition.spec import Bench
from ray_zep.report.output import BenchResult
from ray_zep.report.text_table import Column, render_table
from ray_zep.sim.calibration import Calibration
from ray_zep_workers.bench_calibrate import JOB_RUNS, uneven
from ray_zep_workers.bench_train import TrainBenchRow, run_train_bench

NAME = "validate"
HELP = "the simulator against real CPU runs"

WEIGHTS = (WeightsMode.REPLICATED, WeightsMode.FSDP)


def _modes(bench: Bench) -> tuple[str, ...]:
    """Every placement the registry lists for `bench` under each of `WEIGHTS`."""
    placements = registry.listed(bench)
    return tuple(f"{p}/{w.value}" for p, w in itertools.product(placements, WEIGHTS))


MODES = _modes(Bench.VALIDATE)
QUICK_MODES = _modes(Bench.VALIDATE_QUICK)
STEPS = 12
"""Steps each mode trains (the first 2 are warm-up). With 8, one step of a host's hiccup
moved a mode's throughput by 8% (run 17 of `BENCHMARKS.md`: one step of six took 3.46 s,
the others 1.67-2.75 s, and swapped two pairs the measurement counted as resolved). Ten
timed steps cut one step's weight from a sixth to a tenth and see more of the data's
batches (steps 2-7 of the demo hold one mixed batch), for about 3 minutes more."""
QUICK_STEPS = 8
"""Steps per mode of `--quick`, which stays under 10 minutes on 2 cores."""
QUICK_JOB_RUNS = 1
"""`--quick` calibrates the job share and FSDP2's units on one pair of runs, not
`ray_zep_workers.bench_calibrate.JOB_RUNS`: about 2.5 minutes less, so `--quick` stays under 10
minutes on 2 cores, for a noisier calibration."""
QUICK_LINK_ROUNDS = 1
"""`--quick` measures the links once, not `ray_zep.bench.calibrate_links.ROUNDS` times
(about 20 s less: with three rounds it took 9.8 minutes on a 2-core AMD EPYC VM)."""
GOAL = 0.20
"""Largest relative error of a prediction the issue accepts."""
RESOLVED_SIGMAS = 2.0
"""Two runs rank each other when their measured throughputs differ by more than this
many standard errors of the difference (about 95% one way): an order the measurement
does not resolve is one the next run may swap, so a prediction cannot be held to it."""


@dataclass
class Validation:
    cpu: list[TrainBenchRow]
    paper: list[PaperRow]
    calibration: Calibration

    def rows(self) -> list[dict]:
        out: list[dict] = [
            {
                "kind": "cpu",
                "mode": r.name,
                "predicted_tokens_per_s": r.predicted_tokens_per_second,
                "measured_tokens_per_s": r.measured_tokens_per_second,
                "predicted_over_measured": r.predicted_over_measured,
                "core_share": r.core_share,
                "measured_error": r.measured_error,
                "probed_shares": r.probed_shares,
            }
            for r in self.cpu
        ]
        picked = self.chosen()
        if picked is not None:
            chosen, best = picked
            out.append(
                {
                    "kind": "auto",
                    "chosen": chosen.name,
                    "fastest_measured": best.name,
                    "chosen_over_fastest": chosen.measured_tokens_per_second
                    / best.measured_tokens_per_second,
                }
            )
        if self.cpu:
            out.append(self.ranking())
        return out + [row.to_dict() for row in self.paper]

    def chosen(self) -> tuple[TrainBenchRow, TrainBenchRow] | None:
        """(the mode the simulator ranks first, the mode measured fastest): what `plan
        --auto` would choose among these modes, against the best of them."""
        rows = [r for r in self.cpu if r.predicted_over_measured is not None]
        if not rows:
            return None
        chosen = max(rows, key=lambda r: r.predicted_tokens_per_second)
        return chosen, max(rows, key=lambda r: r.measured_tokens_per_second)

    def misordered(self, resolved: bool | None = None) -> list[tuple[str, str]]:
        """Pairs of modes the prediction ranks the other way round than the measurement,
        (measured faster, measured slower); `resolved`: only the pairs whose measured
        order the runs resolve (True, `resolves`) or only those they do not (False)."""
        rows = [r for r in self.cpu if r.predicted_over_measured is not None]
        out = []
        for a, b in itertools.combinations(rows, 2):
            measured = a.measured_tokens_per_second - b.measured_tokens_per_second
            predicted = a.predicted_tokens_per_second - b.predicted_tokens_per_second
            if measured * predicted >= 0 or resolved not in (None, resolves(a, b)):
                continue
            out.append((a.name, b.name) if measured > 0 else (b.name, a.name))
        return out

    def resolved_pairs(self) -> tuple[int, int]:
        """(pairs whose measured order the runs resolve, pairs in all)."""
        rows = [r for r in self.cpu if r.predicted_over_measured is not None]
        pairs = list(itertools.combinations(rows, 2))
        return sum(resolves(a, b) for a, b in pairs), len(pairs)

    def ranking(self) -> dict:
        """The ranking row: the pairs the measurement resolves and the pairs predicted
        the other way round, among those and among the rest."""
        resolved, pairs = self.resolved_pairs()
        return {
            "kind": "ranking",
            "pairs": pairs,
            "resolved_pairs": resolved,
            "swapped_resolved": [list(p) for p in self.misordered(resolved=True)],
            "swapped_unresolved": [list(p) for p in self.misordered(resolved=False)],
        }

    def _ranking_lines(self) -> list[str]:
        row = self.ranking()
        swapped, loose = row["swapped_resolved"], row["swapped_unresolved"]
        head = (
            f"ranking: {row['resolved_pairs']} of {row['pairs']} pairs resolved by the "
            f"measurement (> {RESOLVED_SIGMAS:g} standard errors apart): "
        )
        lines = [head + ("all predicted in order" if not swapped else f"{len(swapped)} swapped: "
                         + ", ".join(self._swap(a, b) for a, b in swapped))]  # fmt: skip
        if loose:
            lines.append(
                f"  among the pairs the measurement does not resolve, {len(loose)} predicted the "
                "other way: " + ", ".join(self._swap(a, b) for a, b in loose)
            )
        return lines

    def _swap(self, faster: str, slower: str) -> str:
        """A swapped pair with how far apart it measured and how far the other way it was
        predicted (a swap of a near tie in the prediction reads differently from one the
        model gets wrong by a wide margin)."""
        rows = {r.name: r for r in self.cpu}
        a, b = rows[faster], rows[slower]
        measured = a.measured_tokens_per_second / b.measured_tokens_per_second - 1
        predicted = a.predicted_tokens_per_second / b.predicted_tokens_per_second - 1
        return f"{faster} > {slower} (measured {measured:+.0%}, predicted {predicted:+.1%})"

    def footer(self) -> list[str]:
        """The lines under the modes' table: the ranking, a calibration whose pairs
        disagree, the simulator's choice, then the paper headlines' table."""
        lines = self._ranking_lines()
        if (warning := uneven(self.calibration.job_shares)) is not None:
            lines.append(f"calibration: {warning}")
        picked = self.chosen()
        if picked is not None:
            chosen, best = picked
            share = chosen.measured_tokens_per_second / best.measured_tokens_per_second
            lines.append(
                f"chosen by the simulator: {chosen.name}, measured at {share:.0%} of the "
                f"fastest measured ({best.name})"
            )
        return [*lines, "", render_table(self.paper, PAPER_COLUMNS)]


def resolves(a: TrainBenchRow, b: TrainBenchRow) -> bool:
    """Whether two runs measured their order: their throughputs differ by more than
    `RESOLVED_SIGMAS` standard errors of the difference (`TrainBenchRow.measured_error`;
    a run without one resolves every pair)."""
    if a.measured_error is None or b.measured_error is None:
        return True
    ma, mb = a.measured_tokens_per_second, b.measured_tokens_per_second
    spread = math.hypot(ma * a.measured_error, mb * b.measured_error)
    return abs(ma - mb) > RESOLVED_SIGMAS * spread


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default="conf/demo.yaml", help="YAML config")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument("--quick", action="store_true", help="6 of the 14 modes (all headlines)")
    parser.add_argument(
        "--steps", type=int, help="steps per mode (2 warm-up; default 12, with --quick 8)"
    )
    parser.add_argument(
        "--sittings",
        type=int,
        default=1,
        help="runs of each mode, in passes over the modes (every second pass in reverse "
        "order); a mode's figures are over all its runs (default 1)",
    )
    parser.add_argument("--calibration", help="calibration.json (default: measure now)")


def run(args: argparse.Namespace) -> BenchResult:
    if args.steps is not None:
        at_least("--steps", args.steps, 3, "the first two are warm-up")
    at_least("--sittings", args.sittings, 1, "runs of each mode")
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    calibration = Calibration.load(args.calibration) if args.calibration else None
    out = Path(args.out)
    validation = run_validate(
        args.config, args.overrides, args.quick, steps, out.resolve(), calibration, args.sittings
    )
    spec = {"config": args.config, "overrides": args.overrides, "steps": steps,
            "quick": args.quick, "sittings": args.sittings}  # fmt: skip
    return bench_result(validation, spec, [validation.calibration.save(out / "calibration.json")])


def bench_result(validation: Validation, spec: dict, written: list[Path]) -> BenchResult:
    """What the writer prints and saves of a validation: its rows, the modes' table with
    the ranking and the headlines under it, and the calibration saved beside."""
    return BenchResult.from_rows(
        NAME,
        spec,
        validation.cpu,
        COLUMNS,
        records=validation.rows(),
        footer=validation.footer(),
        written=written,
    )


def _goal(row: TrainBenchRow) -> str | None:
    ratio = row.predicted_over_measured
    if ratio is None:
        return None
    return "met" if abs(ratio - 1) <= GOAL else f"off by > {GOAL:.0%}"


COLUMNS = (
    Column("mode", "name"),
    Column("measured k tok/s", "measured_tokens_per_second", ".2f", 1e3),
    Column("+-", "measured_error", ".0%"),
    Column("predicted k tok/s", "predicted_tokens_per_second", ".2f", 1e3),
    Column("pred/meas", "predicted_over_measured", ".2f"),
    Column(f"within {GOAL:.0%}", _goal),
)
PAPER_COLUMNS = (
    Column("paper headline", "name"),
    Column("paper", "paper", ".3g"),
    Column("simulated", "simulated", ".3g"),
    Column("explained", lambda row: row.explained or None),
)


def run_validate(
    config_path: str | None,
    overrides: list[str],
    quick: bool,
    steps: int,
    out: Path,
    calibration: Calibration | None = None,
    sittings: int = 1,
) -> Validation:
    """Calibrate, train, predict and simulate the headlines (module docstring);
    `sittings`: runs of each mode, in passes over the modes
    (`ray_zep_workers.bench_train.sitting_order`)."""
    modes, job_runs = (QUICK_MODES, QUICK_JOB_RUNS) if quick else (MODES, JOB_RUNS)
    link_rounds = QUICK_LINK_ROUNDS if quick else LINK_ROUNDS
    cpu, calibration = run_train_bench(
        config_path, overrides, modes, steps, out, calibration, job_runs, link_rounds, sittings
    )
    return Validation(cpu, paper_rows(quick), calibration)
