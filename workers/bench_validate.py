"""`ray-zep bench validate`: the simulator against what runs, in one command.

1. calibrates this machine (`ray-zep bench calibrate`: kernels, the virtual
   cluster's links, the trainer's fixed step cost);
2. trains every sequence placement with replicated weights and with FSDP2 on the
   configured virtual cluster (`ray-zep bench train`'s runs; `--quick`: a subset,
   and a calibration on one pair of job runs, `QUICK_JOB_RUNS`);
3. replays the same batches through the simulator on the calibration, with each
   run's share of the cores probed around it (`ray_zep.bench.core_share`);
4. simulates the papers' headline setups (`ray_zep.bench.headlines`).

Rows: `{"kind": "cpu", "mode", "predicted_tokens_per_s", "measured_tokens_per_s",
"predicted_over_measured", "core_share"}` per mode, `{"kind": "auto", "chosen", "fastest_measured",
"chosen_over_fastest"}` (the mode the simulator ranks first, as `plan --auto` ranks,
against the fastest measured) and `{"kind": "paper", "name", "paper", "simulated",
"explained"}` per headline.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from ray_zep.bench.calibrate import Calibration
from ray_zep.bench.headlines import PaperRow, paper_rows
from ray_zep.parallel.axes import Placement, WeightsMode
from workers.bench_train import TrainBenchRow, run_train_bench
from workers.calibrate_step import JOB_RUNS

PLACEMENTS = (
    Placement.WHOLE,
    Placement.ZEPPELIN,
    Placement.TE_CP,
    Placement.LLAMA_CP,
    Placement.HYBRID_DP,
    Placement.ULYSSES,
    Placement.USP,
)
WEIGHTS = (WeightsMode.REPLICATED, WeightsMode.FSDP)
MODES = tuple(f"{p.value}/{w.value}" for p, w in itertools.product(PLACEMENTS, WEIGHTS))
QUICK_MODES = tuple(
    f"{p.value}/{w.value}"
    for p, w in itertools.product((Placement.WHOLE, Placement.ZEPPELIN, Placement.TE_CP), WEIGHTS)
)
QUICK_JOB_RUNS = 1
"""`--quick` calibrates the job share and FSDP2's units on one pair of runs, not
`workers.calibrate_step.JOB_RUNS`: about 2.5 minutes less, so `--quick` stays under 10
minutes on 2 cores, for a noisier calibration."""
GOAL = 0.20
"""Largest relative error of a prediction the issue accepts."""


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
        return out + [row.to_dict() for row in self.paper]

    def chosen(self) -> tuple[TrainBenchRow, TrainBenchRow] | None:
        """(the mode the simulator ranks first, the mode measured fastest): what `plan
        --auto` would choose among these modes, against the best of them."""
        rows = [r for r in self.cpu if r.predicted_over_measured is not None]
        if not rows:
            return None
        chosen = max(rows, key=lambda r: r.predicted_tokens_per_second)
        return chosen, max(rows, key=lambda r: r.measured_tokens_per_second)

    def misordered(self) -> list[tuple[str, str]]:
        """Pairs of modes the prediction ranks the other way round than the measurement."""
        rows = [r for r in self.cpu if r.predicted_over_measured is not None]
        out = []
        for a, b in itertools.combinations(rows, 2):
            measured = a.measured_tokens_per_second - b.measured_tokens_per_second
            predicted = a.predicted_tokens_per_second - b.predicted_tokens_per_second
            if measured * predicted < 0:
                out.append((a.name, b.name) if measured > 0 else (b.name, a.name))
        return out

    def table(self) -> str:
        lines = [f"{'mode':<22}{'measured k tok/s':>18}{'predicted':>11}{'pred/meas':>11}"]
        for r in self.cpu:
            ratio = r.predicted_over_measured
            flag = "" if ratio is None or abs(ratio - 1) <= GOAL else "  off by > 20%"
            lines.append(
                f"{r.name:<22}{(r.measured_tokens_per_second or 0) / 1e3:>18.2f}"
                f"{(r.predicted_tokens_per_second or 0) / 1e3:>11.2f}"
                f"{ratio or float('nan'):>11.2f}{flag}"
            )
        swapped = self.misordered()
        lines.append(
            "ranking: preserved" if not swapped
            else "ranking: measured faster first, predicted the other way: "
            + ", ".join(f"{a} > {b}" for a, b in swapped)
        )  # fmt: skip
        picked = self.chosen()
        if picked is not None:
            chosen, best = picked
            share = chosen.measured_tokens_per_second / best.measured_tokens_per_second
            lines.append(
                f"chosen by the simulator: {chosen.name}, measured at {share:.0%} of the "
                f"fastest measured ({best.name})"
            )
        lines.append("")
        lines.append(f"{'paper headline':<44}{'paper':>10}{'simulated':>11}  explained")
        for row in self.paper:
            lines.append(
                f"{row.name:<44}{row.paper:>10.3g}{row.simulated:>11.3g}  {row.explained or '-'}"
            )
        return "\n".join(lines)


def run_validate(
    config_path: str | None,
    overrides: list[str],
    quick: bool,
    steps: int,
    out: Path,
    calibration: Calibration | None = None,
) -> Validation:
    """Calibrate, train, predict and simulate the headlines (module docstring)."""
    modes, job_runs = (QUICK_MODES, QUICK_JOB_RUNS) if quick else (MODES, JOB_RUNS)
    cpu, calibration = run_train_bench(
        config_path, overrides, modes, steps, out, calibration, job_runs
    )
    return Validation(cpu, paper_rows(quick), calibration)
