"""`ray-zep bench train`: placements and weights modes trained for real on the CPU virtual
cluster, side by side with the simulator's prediction for the same batches and the same CPU.

A mode is `PLACEMENT[/WEIGHTS]`: a simulator variant (a placement, with the routing
and remapping layers as `ray-zep simulate` names them) or `whole` (rank-packed
whole sequences), with replicated weights unless another weights mode is named
(`te_cp/fsdp`); a weights mode alone (`tawpipe`) trains whole sequences.
`zeppelin` keeps the config's `parallel.zone_policy` (`work` by default); `zeppelin+cost`
sets `cost`, so `--strategies zeppelin+cost,zeppelin+work` trains the cost-zoned and the
work-balanced plans side by side on the same batches (the `FLOPs max/mean` column is the
metrics' `rank_flops` balance of the steady steps). Each
trains K steps from the same config (so the data actor draws the same batches)
through the Ray driver, like `ray-zep train`. Measured tokens/s are the steady
state: the first `WARM_UP_STEPS` are left out. The prediction replays those
batches through the simulator (`ray_zep.sim.replay`) on this machine's
calibration (`Calibration.hardware`: one virtual GPU is one single-threaded
process at its share of the cores, probed just before and just after the run
(`ray_zep.core_share`: a virtual machine's cores come and go with its host's
load); every link takes the measured message cost among that many processes; the
trainer's fixed step cost measured on tiny steps, `ray_zep_workers.bench_calibrate`).
`--compare compression` hands over to `ray_zep_workers.bench_compression`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import statistics
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ray_zep import command_args, steplog
from ray_zep.bench.calibrate import calibrate
from ray_zep.bench.calibrate_links import ROUNDS as LINK_ROUNDS
from ray_zep.bench.calibrate_ring import RingSittings
from ray_zep.config import Config, load_config
from ray_zep.constants import METRICS_FILE_NAME
from ray_zep.core_share import run_share
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import WeightsMode
from ray_zep.partition import registry
from ray_zep.partition.spec import Bench, Role
from ray_zep.report.output import BenchResult
from ray_zep.report.text_table import Column
from ray_zep.report.timeline import draw_throughput
from ray_zep.sim.calibration import Calibration
from ray_zep.sim.compare import VARIANTS
from ray_zep.sim.replay import replay
from ray_zep_workers.bench_calibrate import JOB_RUNS, JobSittings, spread, uneven
from ray_zep_workers.steady_state import TIMING_OVERRIDES, WARM_UP_STEPS, steady_totals

if TYPE_CHECKING:
    from ray_zep_workers.driver import RunSummary

log = logging.getLogger(__name__)

DEFAULT_STRATEGIES = registry.listed(Bench.TRAIN)
NAME = "train"
HELP = "real CPU runs next to the simulator"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default="conf/zeppelin.yaml", help="YAML config")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument(
        "--strategies",
        help="default: zeppelin,te_cp,llama_cp,hybrid_dp (also zeppelin+work, whole, "
        "PLACEMENT/WEIGHTS, a weights mode)",
    )
    parser.add_argument("--steps", type=int, default=8, help="steps per mode (2 warm-up)")
    parser.add_argument("--calibration", help="calibration.json (default: measure now)")
    parser.add_argument(
        "--compare",
        choices=["compression"],
        help="compression: each of --cases with comm.compression off and on, side by side",
    )
    parser.add_argument(
        "--cases", help="--compare compression: fsdp,zeppelin+fsdp,moe_ep2_1a1m (also tawpipe)"
    )
    parser.add_argument("--modes", help="--compare compression: off,auto,always")


def run(args: argparse.Namespace) -> BenchResult:
    command_args.at_least("--steps", args.steps, 3, "the first two are warm-up")
    if args.compare == "compression":
        from ray_zep_workers import bench_compression

        return bench_compression.run(args)
    strategies = check_names(command_args.names(args.strategies, DEFAULT_STRATEGIES))
    calibration = Calibration.load(args.calibration) if args.calibration else None
    rows, calibration = run_train_bench(
        args.config, args.overrides, strategies, args.steps, Path(args.out).resolve(), calibration
    )
    spec = {"config": args.config, "overrides": args.overrides, "steps": args.steps}
    return bench_result(rows, calibration, spec)


def bench_result(rows: list[TrainBenchRow], calibration: Calibration, spec: dict) -> BenchResult:
    """The modes' table, and the calibration's rates and links in the spec."""
    link = {
        "latency_s": calibration.link_latency_s,
        "bandwidth": calibration.link_bandwidth,
        "core_share": calibration.core_share,
    }
    measured = [r.measured_tokens_per_second for r in rows]
    chart = partial(draw_throughput, "measured on this CPU", [r.name for r in rows], measured)
    spec = {**spec, "rates": calibration.rates.__dict__, "link": link}
    return BenchResult.from_rows(NAME, spec, rows, COLUMNS, records=row_dicts(rows), draw=chart)


@dataclasses.dataclass
class TrainBenchRow:
    name: str
    """A simulator variant or a weights mode (module docstring)."""
    measured_tokens_per_second: float | None
    predicted_tokens_per_second: float | None
    measured_step_seconds: float | None
    predicted_step_seconds: float | None
    final_loss: float | None
    core_share: float | None = None
    """Share of a core each rank had during the run (`run_share` of the probes around it)."""
    measured_error: float | None = None
    """Relative standard error of the measured throughput: the spread of the steady
    steps' measured over predicted seconds (what the batches' own differences do not
    explain), over the root of their number; None with fewer than 2 steps."""
    probed_shares: tuple[float, ...] | None = None
    """The shares probed just before and just after the run (`core_share` combines them
    with the calibration's, `ray_zep.core_share.run_share`); of every run in
    turn for a mode run in several sittings (`combine_sittings`)."""
    flops_max_over_mean: float | None = None
    """The steady steps' busiest rank's FLOPs over the mean (the metrics'
    `rank_flops`), averaged over the steps: the work balance the run had."""

    @property
    def predicted_over_measured(self) -> float | None:
        if not self.measured_tokens_per_second or not self.predicted_tokens_per_second:
            return None
        return self.predicted_tokens_per_second / self.measured_tokens_per_second


WEIGHTS_NAMES = tuple(m.value for m in WeightsMode if m is not WeightsMode.REPLICATED)
"""Weights modes named alone: trained with whole sequences."""
WHOLE = registry.playing(Role.PACKED).name


def check_names(names) -> tuple[str, ...]:
    """`names` if each is a mode: `PLACEMENT[/WEIGHTS]` (a simulator variant or whole,
    replicated weights unless named) or a weights mode alone (with whole sequences).

    Raises:
        ConfigError: naming the first unknown one and the choices.
    """
    trainable = [n for n, v in VARIANTS.items() if not v.scheduled]  # simulated only
    for name in names:
        placement, _, weights = name.partition("/")
        known = placement in trainable or placement == WHOLE
        if weights:
            known = known and weights in (m.value for m in WeightsMode)
        if not known and name not in WEIGHTS_NAMES:
            choices = ", ".join((*trainable, WHOLE, *WEIGHTS_NAMES))
            raise ConfigError(
                f"--strategies: {name!r} is not one of {choices} (optionally /WEIGHTS, "
                "e.g. te_cp/fsdp)"
            )
    return tuple(names)


def variant_overrides(name: str) -> list[str]:
    """The config overrides of a mode (see `check_names`)."""
    placement, _, weights = name.partition("/")
    if name in WEIGHTS_NAMES:
        placement, weights = WHOLE, name
    weights = weights or WeightsMode.REPLICATED.value
    if placement == WHOLE:  # whole sequences, rank-packed: nothing to route or remap
        return [
            f"parallel.sequence={WHOLE}",
            f"parallel.weights={weights}",
            "parallel.routing=false",
            "parallel.remap=false",
            "data.packing=rank",
        ]
    variant = VARIANTS[placement]
    out = [
        f"parallel.sequence={variant.placement.value}",
        f"parallel.weights={weights}",
        f"parallel.routing={str(variant.routed).lower()}",
        f"parallel.remap={str(variant.remap).lower()}",
    ]
    if variant.zone_policy is not None:
        out.append(f"parallel.zone_policy={variant.zone_policy.value}")
    return out


def run_train_bench(
    config_path: str | None,
    overrides: list[str],
    strategies: tuple[str, ...],
    steps: int,
    out: Path,
    calibration: Calibration | None = None,
    job_runs: int = JOB_RUNS,
    link_rounds: int = LINK_ROUNDS,
    sittings: int = 1,
) -> tuple[list[TrainBenchRow], Calibration]:
    """Train each mode `steps` steps and predict the same steps (module docstring);
    without a `calibration`, calibrate first: the links from `link_rounds` measurements,
    the job share from `job_runs` pairs of runs spread over the modes' runs
    (`ray_zep_workers.bench_calibrate.JobSittings`) and the ring step from sittings beside every
    pair after the first (`ray_zep.bench.calibrate_ring.RingSittings`), so every mode is
    predicted once all ran.
    With `sittings` > 1 every mode runs that many times, in passes over the modes
    (`sitting_order`), and its row combines its runs (`combine_sittings`)."""
    from ray_zep_workers.driver import train

    base = load_config(config_path, overrides)
    job_sittings, ring_sittings, pairs_before = None, None, []
    if calibration is None:
        calibration = calibrate(base, torch.device("cpu"), link_rounds=link_rounds)
        job_sittings = JobSittings.start(config_path, overrides, calibration, out / "tiny")
        ring_sittings = RingSittings.start(base, calibration)
    order = sitting_order(strategies, sittings)
    if job_sittings is not None:
        pairs_before = spread(job_runs, len(order))
    probe = calibration.share_probe(build_shape(base.model))  # an old file fails here
    runs = []

    def calibrate_before(index: int) -> None:
        """The job pairs due before run `index`, each after the first with a ring sitting
        (the calibration measured the first)."""
        for _ in range(pairs_before.count(index)):
            if job_sittings.tried > 0:
                ring_sittings.measure()
            job_sittings.measure()

    for index, (name, sitting) in enumerate(order):
        calibrate_before(index)
        run_dir = out / run_dir_name(name, sitting)
        extra = [*variant_overrides(name), *TIMING_OVERRIDES, f"train.steps={steps}"]
        extra.append(f"train.out_dir={run_dir}")
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resume
        config = load_config(config_path, [*overrides, *extra])
        runs.append((name, config, *probe.readings(partial(train, config))))
    if job_sittings is not None:
        calibrate_before(len(order))
        calibration = ring_sittings.applied(job_sittings.calibration())
        log.info("calibration: %s", ring_sittings.summary())
        if (warning := uneven(calibration.job_shares)) is not None:
            log.warning(warning)
    rows = [_predicted(calibration, steps, *run) for run in runs]
    by_mode = {name: [r for r in rows if r.name == name] for name in strategies}
    return [combine_sittings(found) for found in by_mode.values()], calibration


def sitting_order(strategies: tuple[str, ...], sittings: int) -> list[tuple[str, int]]:
    """(mode, sitting) of every run: `sittings` passes over the modes, every second one
    in reverse order, so a mode's runs lie apart in time and no mode is always first."""
    order: list[tuple[str, int]] = []
    for sitting in range(sittings):
        names = strategies if sitting % 2 == 0 else tuple(reversed(strategies))
        order.extend((name, sitting) for name in names)
    return order


def run_dir_name(name: str, sitting: int) -> str:
    """The folder of a mode's run: `te_cp+fsdp`, then `te_cp+fsdp.sitting2` and so on."""
    folder = name.replace("/", "+")
    return folder if sitting == 0 else f"{folder}.sitting{sitting + 1}"


def combine_sittings(rows: list[TrainBenchRow]) -> TrainBenchRow:
    """One mode's row from its runs in several sittings (one run: that run's row).

    Every run trains the same batches, so the mode's throughputs are over all their
    steps (the harmonic mean of the runs'). Its error is the larger of the runs'
    step-to-step error (combined) and the standard error of their predicted over
    measured throughput across the runs: what the host's lending moves from one run
    to the next, which the steps inside one run do not show (BENCHMARKS.md, runs
    23-24: one run of a mode measured 13-19% below its other runs).
    """
    if len(rows) == 1:
        return rows[0]
    probes = tuple(p for r in rows for p in (r.probed_shares or ()))
    return TrainBenchRow(
        rows[0].name,
        _harmonic_mean([r.measured_tokens_per_second for r in rows]),
        _harmonic_mean([r.predicted_tokens_per_second for r in rows]),
        _mean([r.measured_step_seconds for r in rows]),
        _mean([r.predicted_step_seconds for r in rows]),
        rows[0].final_loss,
        _mean([r.core_share for r in rows]),
        _sittings_error(rows),
        probes or None,
        _mean([r.flops_max_over_mean for r in rows]),
    )


def _harmonic_mean(values: list[float | None]) -> float | None:
    return statistics.harmonic_mean(values) if all(values) else None


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if len(present) == len(values) else None


def _sittings_error(rows: list[TrainBenchRow]) -> float | None:
    """The larger of the runs' step-to-step errors combined and the standard error of
    their predicted over measured throughput (`combine_sittings`)."""
    count = len(rows)
    errors = [r.measured_error for r in rows if r.measured_error is not None]
    ratios = [r.predicted_over_measured for r in rows if r.predicted_over_measured]
    found = []
    if len(errors) == count:
        found.append(sum(e * e for e in errors) ** 0.5 / count)
    if len(ratios) == count:
        found.append(statistics.stdev(ratios) / statistics.fmean(ratios) / count**0.5)
    return max(found) if found else None


def _predicted(
    calibration: Calibration,
    steps: int,
    name: str,
    config: Config,
    summary: RunSummary,
    before: float,
    after: float,
) -> TrainBenchRow:
    """The row of a run: measured, and predicted at the share probed around it."""
    share = run_share(before, after, calibration.core_share)
    step_rows = steplog.step_rows(summary.run_dir / METRICS_FILE_NAME)
    seconds, tokens = steady_totals(step_rows)
    hardware = dataclasses.replace(calibration, run_share=share).hardware(config.topology)
    predicted = replay(config, hardware, WARM_UP_STEPS, steps - WARM_UP_STEPS, False)
    measured_steps = [r["step_seconds"] for r in step_rows[WARM_UP_STEPS:]]
    return TrainBenchRow(
        name,
        tokens / seconds if seconds else None,
        predicted.tokens_per_second,
        seconds / max(1, steps - WARM_UP_STEPS) if seconds else None,
        predicted.step_seconds,
        summary.final_loss,
        share,
        relative_error(measured_steps, [s.step_seconds for s in predicted.steps]),
        (before, after),
        steady_flop_imbalance(step_rows),
    )


def steady_flop_imbalance(rows: list[dict], warm_up: int = WARM_UP_STEPS) -> float | None:
    """Mean over the step rows after the first `warm_up` of their `rank_flop_imbalance`
    (None when the rows carry none)."""
    found = [r["rank_flop_imbalance"] for r in rows[warm_up:] if "rank_flop_imbalance" in r]
    return statistics.fmean(found) if found else None


def relative_error(measured: list[float], predicted: list[float]) -> float | None:
    """Relative standard error of a run's mean step time: the spread of its steps'
    `measured / predicted` seconds (the same batches, so what one batch costs more than
    another cancels), over the root of the number of steps; None below 2 steps."""
    ratios = [m / p for m, p in zip(measured, predicted, strict=False) if p > 0]
    if len(ratios) < 2:
        return None
    mean = statistics.fmean(ratios)
    return statistics.stdev(ratios) / mean / len(ratios) ** 0.5 if mean > 0 else None


COLUMNS = (
    Column("strategy", "name"),
    Column("measured k tok/s", "measured_tokens_per_second", ".2f", 1e3),
    Column("predicted k tok/s", "predicted_tokens_per_second", ".2f", 1e3),
    Column("pred/meas", "predicted_over_measured", ".2f"),
    Column("meas s/step", "measured_step_seconds", ".3f"),
    Column("pred s/step", "predicted_step_seconds", ".3f"),
    Column("final loss", "final_loss", ".4f"),
    Column("core share", "core_share", ".2f"),
    Column("FLOPs max/mean", "flops_max_over_mean", ".2f"),
)


def row_dicts(rows: list[TrainBenchRow]) -> list[dict]:
    return [
        {**dataclasses.asdict(r), "predicted_over_measured": r.predicted_over_measured}
        for r in rows
    ]
