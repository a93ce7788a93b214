"""`ray-zep bench calibrate`: this device's rates (`ray_zep.bench.calibrate`) and, on a
CPU virtual cluster, the fixed cost of a training step, measured through Ray; it saves
OUT/calibration.json, which `simulate`, `plan --auto` and the other benches load.

Besides its layers, a step on every rank fetches its shard from the data actor,
clips the gradients (an all-reduce of their norm), updates, accounts the step
(modelled memory, FLOPs, traffic) and all-reduces its totals, while the driver
and the data actor share the same cores. On a virtual cluster these host-side
parts cost tens of milliseconds. Here the configured cluster trains the
configured model through the Ray driver, as `ray-zep train` does, on batches of
32 tokens per rank with whole sequences and replicated weights; the step time
beyond what the simulator models for those steps (`ray_zep.sim.step`) is the
fixed cost it adds to every step it simulates on this machine
(`ComputeRates.step_overhead_s`). Steps of `JOB_TOKENS` tokens per rank, the same
way, then give the share of its measured compute rate a rank keeps inside the job
(`Calibration.job_share`: the ranks compute beside Ray's own processes, the driver
and the data actor, on the same cores): the step time beyond the fixed cost over
what the simulator models for it. Each such run is followed by the same steps with
FSDP2, and what they take beyond the simulator's FSDP2 step at that run's share is
what each of its units adds (`ComputeRates.fsdp_unit_overhead_s`: its hooks, the
copies into and out of the gathered buffers, and its collectives' cost beyond the
links' model). Tiny steps would not do for that: a collective costs more the
longer the ranks compute between two of them (`BENCHMARKS.md`): on tiny steps
FSDP2 measured 0 and 0.2 ms per unit over the model in two calibrations, where
the validated runs with FSDP2 took 47-77 ms per step (6 units) more than the
simulator gave them beside the same runs with replicated weights.

These runs train on synthetic lengths with whole sequences only, so the modes
`ray-zep bench validate` compares are predicted, not fitted.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from functools import partial
from pathlib import Path

import numpy as np

from ray_zep import steplog
from ray_zep.bench.calibrate import calibrate, calibration_table
from ray_zep.command_args import optional_config, optional_config_args
from ray_zep.config import load_config
from ray_zep.constants import METRICS_FILE_NAME
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import WeightsMode
from ray_zep.parallel.memory import fsdp_units
from ray_zep.report.output import BenchResult
from ray_zep.sim.calibration import Calibration
from ray_zep.sim.replay import replay

NAME = "calibrate"
HELP = "measure this device's compute rates"

TINY_STEPS = (
    "parallel.sequence=whole",
    "parallel.weights=replicated",
    "parallel.routing=false",
    "parallel.remap=false",
    "data.packing=rank",
    "data.source=synthetic:arxiv",
    "data.length_scale=0.002",
    "data.overlong=split",
    "train.tokens_per_rank=32",
    "train.checkpoint_every=0",
    "metrics.memory_every=0",
    "metrics.progress=false",
)
"""Batches of 32 tokens per rank: almost nothing but the step's fixed parts."""
JOB_TOKENS = 768
"""Tokens per rank of the steps that measure `Calibration.job_share`: compute
dominates, a step stays short."""
STEPS = 26
"""Steps of each run: a tiny step takes tens of milliseconds and a `JOB_TOKENS` step a
few hundred, so 24 timed steps stay a few seconds yet average over the host's
scheduling (6 timed steps measured the job share at 0.69-0.82 on one machine within
an hour)."""
WARM_UP = 2
"""Steps left out (process groups, first plans, allocator)."""
JOB_RUNS = 3
"""Runs of `JOB_TOKENS` steps, each followed by its FSDP2 twin; the job share is their
median, and so is the FSDP2 units' cost. The job share scales every rate of every
prediction, and one run measured it at 0.69-0.94 on one machine within an hour
while the runs of one sitting agreed within 5%: a run that lands on a busy stretch of
the host should not move every prediction. Three pairs in a row can all land on one:
in one calibration the three measured 0.63 (usual 0.82-0.88: job steps of 339-421 ms,
usual 266-289 ms; the message cost 4.4 ms, usual 2.3-3.6), and the 14 modes trained in
the 20 minutes after it were predicted at 0.61-0.80 of what they measured (at 0.83,
12 of 14 within 20%), so `bench validate` spreads its pairs over its runs (`JobSittings`)."""
UNEVEN_SHARES = 1.15
"""Highest over lowest job share of one calibration's pairs above which it warns: pairs
back to back agreed within 5%, pairs spread over a 20-minute validate within 7% and 14%
(runs 17 and 18 of `BENCHMARKS.md`); run 15's slow sitting measured 0.63 against the
usual 0.82-0.88."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    optional_config_args(parser)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per size")


def run(args: argparse.Namespace) -> BenchResult:
    """Calibrate the configured device; on CPU add the trainer's fixed step cost."""
    from ray_zep.train.build import resolve_device

    config = optional_config(args)
    device = resolve_device(config.train.device)
    calibration = calibrate(config, device, args.repeats)
    out = Path(args.out)
    if device.type == "cpu":  # the trainer's fixed step cost on this virtual cluster
        calibration = measure_step_overhead(args.config, args.overrides, calibration, out.resolve())
    spec = {"config": args.config, "overrides": args.overrides, "repeats": args.repeats}
    return BenchResult(
        NAME,
        {**spec, "device": device.type},
        [dataclasses.asdict(calibration.rates)],
        calibration_table(calibration),
        written=[calibration.save(out / "calibration.json")],
    )


def measure_step_overhead(
    config_path: str | None,
    overrides: list[str],
    calibration: Calibration,
    out: Path,
    job_runs: int = JOB_RUNS,
) -> Calibration:
    """`calibration` with `rates.step_overhead_s`, `job_share` and
    `rates.fsdp_unit_overhead_s` measured (module docstring): tiny steps with replicated
    weights, then `job_runs` pairs of larger steps, replicated and with FSDP2."""
    sittings = JobSittings.start(config_path, overrides, calibration, out)
    for _ in range(job_runs):
        sittings.measure()
    return sittings.calibration()


@dataclasses.dataclass
class JobSittings:
    """The job share and FSDP2's units measured in pairs of runs that may be minutes
    apart: `bench validate` spreads its pairs over its runs (`spread`), so that a host
    lending less for a few minutes moves one pair, not the share every prediction uses.
    The fixed step cost is measured once, on `start`."""

    config_path: str | None
    overrides: list[str]
    base: Calibration
    """The calibration with the fixed step cost and no job share."""
    out: Path
    shares: list[float] = dataclasses.field(default_factory=list)
    extras: list[float] = dataclasses.field(default_factory=list)
    """What each FSDP2 twin took beyond its simulated step."""
    tried: int = 0
    """Pairs measured so far, kept or not (each in its own folders)."""

    @classmethod
    def start(
        cls, config_path: str | None, overrides: list[str], calibration: Calibration, out: Path
    ) -> JobSittings:
        """Measure the fixed step cost on tiny steps; no pair yet."""
        plain = out / WeightsMode.REPLICATED.value
        overhead = _overhead(config_path, [*overrides, *TINY_STEPS], calibration, plain)
        rates = dataclasses.replace(
            calibration.rates, step_overhead_s=overhead, fsdp_unit_overhead_s=0.0
        )
        base = dataclasses.replace(calibration, rates=rates, job_share=None, job_shares=())
        return cls(config_path, overrides, base, out)

    def measure(self) -> None:
        """One pair: `JOB_TOKENS` steps with replicated weights give a job share, their
        FSDP2 twin, predicted at that share, what FSDP2's units add."""
        run, self.tried = self.tried, self.tried + 1
        overhead = self.base.rates.step_overhead_s
        larger = [*self.overrides, *TINY_STEPS, f"train.tokens_per_rank={JOB_TOKENS}"]
        measured, simulated = _steps(self.config_path, larger, self.base, self.out / f"job{run}")
        if not (simulated > overhead and measured > overhead):
            return  # the steps came out within the fixed cost
        share = (simulated - overhead) / (measured - overhead)
        self.shares.append(share)
        at_share = dataclasses.replace(self.base, job_share=share)
        sharded = [*larger, f"parallel.weights={WeightsMode.FSDP.value}"]
        twin = self.out / f"{WeightsMode.FSDP.value}{run}"
        measured, simulated = _steps(self.config_path, sharded, at_share, twin)
        self.extras.append(measured - simulated)

    def calibration(self) -> Calibration:
        """The calibration at the median of the pairs' job shares and FSDP2 excesses (the
        fixed step cost alone without a pair)."""
        if not self.shares:
            return self.base
        config = load_config(self.config_path, [*self.overrides, *TINY_STEPS])
        units = len(fsdp_units(build_shape(config.model), config.parallel.fsdp_unit))
        per_unit = max(0.0, float(np.median(self.extras))) / units
        rates = dataclasses.replace(self.base.rates, fsdp_unit_overhead_s=per_unit)
        share = float(np.median(self.shares))
        return dataclasses.replace(
            self.base, rates=rates, job_share=share, job_shares=tuple(self.shares)
        )


def uneven(shares: tuple[float, ...] | list[float]) -> str | None:
    """A warning when a calibration's job shares spread over more than `UNEVEN_SHARES`
    (highest over lowest): the host lent the machine unevenly while its pairs ran."""
    if len(shares) < 2 or max(shares) <= UNEVEN_SHARES * min(shares):
        return None
    listed = ", ".join(f"{s:.2f}" for s in shares)
    return (
        f"the job share measured {listed} in its pairs of job runs (highest over lowest above "
        f"{UNEVEN_SHARES:g}): the host lent this machine unevenly while they ran; the "
        f"predictions use their median, {float(np.median(shares)):.2f}"
    )


def spread(pairs: int, runs: int) -> list[int]:
    """Before which of `runs` runs each of `pairs` job pairs goes (`runs`: after the
    last), evenly from the first to after the last: 3 pairs around 14 runs go before
    runs 0 and 7 and after run 13."""
    if pairs <= 1:
        return [0] * pairs
    return [round(k * runs / (pairs - 1)) for k in range(pairs)]


def _overhead(
    config_path: str | None, overrides: list[str], calibration: Calibration, out: Path
) -> float:
    """Seconds a tiny step takes beyond what `calibration` simulates for it."""
    measured, simulated = _steps(config_path, overrides, calibration, out)
    return max(0.0, measured - simulated)


def _steps(
    config_path: str | None, overrides: list[str], calibration: Calibration, out: Path
) -> tuple[float, float]:
    """(measured, simulated) mean seconds of the steps after the warm-up of a run."""
    from ray_zep_workers.driver import train

    shutil.rmtree(out, ignore_errors=True)  # a fresh run, never a resume
    extra = [f"train.steps={STEPS}", f"train.out_dir={out}"]
    config = load_config(config_path, [*overrides, *extra])
    probe = calibration.share_probe(build_shape(config.model))
    summary, share = probe.around(partial(train, config), calibration.core_share)
    rows = steplog.step_rows(summary.run_dir / METRICS_FILE_NAME)[WARM_UP:]
    measured = float(np.mean([r["step_seconds"] for r in rows]))
    hardware = dataclasses.replace(calibration, run_share=share).hardware(config.topology)
    simulated = replay(config, hardware, WARM_UP, STEPS - WARM_UP, on_gpu=False)
    return measured, simulated.step_seconds
