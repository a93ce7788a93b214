"""`ray-zep bench train`: placements and weights modes trained for real on the CPU virtual
cluster, side by side with the simulator's prediction for the same batches and the same CPU.

A name is a simulator variant (a placement, with the routing and remapping layers
as `ray-zep simulate` names them) trained with replicated weights, or a weights
mode (tawpipe, weipipe, fsdp, hsdp) trained with whole sequences. Each trains K
steps from the same config (so the data actor draws the same batches) through the
Ray driver, like `ray-zep train`. Measured tokens/s
are the steady state: the first step (process-group warm-up, first plan) is
left out. The prediction simulates those K - 1 batches with this machine's
calibration (`ray_zep.bench.calibrate`): one virtual GPU is one single-threaded
process, and with more processes than cores they share the cores, so compute
rates and the gloo link rate are scaled by cores / ranks; every link of the
virtual topology takes the measured gloo latency and bandwidth.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch

from ray_zep import steplog
from ray_zep.bench.calibrate import Calibration, calibrate, cpu_count
from ray_zep.config import Config, load_config
from ray_zep.constants import METRICS_FILE_NAME
from ray_zep.costmodel import ComputeRates
from ray_zep.errors import ConfigError
from ray_zep.model.shapes import build_shape
from ray_zep.parallel.axes import WEIGHTS_AXES, Placement, WeightsMode
from ray_zep.report.plan_command import PlanRequest, request_lengths
from ray_zep.sim.compare import VARIANTS, simulate_strategies
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.weight_passing import Workload, simulate_step
from ray_zep.topology import build_topology

TIMING_OVERRIDES = ("metrics.memory_every=0",)
"""Timed runs measure no memory: on CPU a measured step runs 2-3x slower (MemTracker
follows every tensor), which would bias the steady-state step time."""
DEFAULT_STRATEGIES = tuple(
    p.value for p in (Placement.ZEPPELIN, Placement.TE_CP, Placement.LLAMA_CP, Placement.HYBRID_DP)
)


@dataclasses.dataclass
class TrainBenchRow:
    name: str
    """A simulator variant or a weights mode (module docstring)."""
    measured_tokens_per_second: float | None
    predicted_tokens_per_second: float | None
    measured_step_seconds: float | None
    predicted_step_seconds: float | None
    final_loss: float | None

    @property
    def predicted_over_measured(self) -> float | None:
        if not self.measured_tokens_per_second or not self.predicted_tokens_per_second:
            return None
        return self.predicted_tokens_per_second / self.measured_tokens_per_second


WEIGHTS_NAMES = tuple(m.value for m in WeightsMode if m is not WeightsMode.REPLICATED)
"""Weights modes the bench trains with whole sequences (the step model predicts them)."""


def check_names(names) -> tuple[str, ...]:
    """`names` if each is a simulated variant or a weights mode.

    Raises:
        ConfigError: naming the first unknown one and the choices.
    """
    for name in names:
        if name not in VARIANTS and name not in WEIGHTS_NAMES:
            choices = ", ".join((*VARIANTS, *WEIGHTS_NAMES))
            raise ConfigError(f"--strategies: {name!r} is not one of {choices}")
    return tuple(names)


def variant_overrides(name: str) -> list[str]:
    if name in WEIGHTS_NAMES:  # whole sequences: nothing to route or remap
        return [
            f"parallel.sequence={Placement.WHOLE.value}",
            f"parallel.weights={name}",
            "parallel.routing=false",
            "parallel.remap=false",
        ]
    variant = VARIANTS[name]
    return [
        f"parallel.sequence={variant.placement.value}",
        f"parallel.weights={WeightsMode.REPLICATED.value}",
        f"parallel.routing={str(variant.routed).lower()}",
        f"parallel.remap={str(variant.remap).lower()}",
    ]


def run_train_bench(
    config_path: str | None,
    overrides: list[str],
    strategies: tuple[str, ...],
    steps: int,
    out: Path,
    calibration: Calibration | None = None,
) -> tuple[list[TrainBenchRow], Calibration]:
    """Train each strategy `steps` steps and predict the same steps (module docstring)."""
    from workers.driver import train

    base = load_config(config_path, overrides)
    calibration = calibration or calibrate(build_shape(base.model), torch.device("cpu"))
    rows = []
    for name in strategies:
        extra = [*variant_overrides(name), *TIMING_OVERRIDES, f"train.steps={steps}"]
        extra.append(f"train.out_dir={out / name}")
        shutil.rmtree(out / name, ignore_errors=True)  # a fresh run, never a resume
        config = load_config(config_path, [*overrides, *extra])
        summary = train(config)
        seconds, tokens = steady_totals(steplog.step_rows(summary.run_dir / METRICS_FILE_NAME))
        predicted = _predict(config, name, steps, calibration)
        rows.append(
            TrainBenchRow(
                name,
                tokens / seconds if seconds else None,
                predicted[1] if predicted else None,
                seconds / max(1, steps - 1) if seconds else None,
                predicted[0] if predicted else None,
                summary.final_loss,
            )
        )
    return rows, calibration


def steady_totals(rows: list[dict]) -> tuple[float, int]:
    """Seconds and tokens of every step row but the first (warm-up)."""
    return sum(r["step_seconds"] for r in rows[1:]), sum(r["tokens"] for r in rows[1:])


def _predict(config: Config, name: str, steps: int, calibration: Calibration):
    """(mean step seconds, tokens/s) the simulator predicts for batches 1..steps-1."""
    topology = build_topology(config.topology)
    share = min(1.0, cpu_count() / topology.world_size)
    r = calibration.rates
    rates = ComputeRates(
        r.attention_forward * share,
        r.attention_backward * share,
        r.matmul * share,
        r.call_overhead_s,
        f"{r.source}, x{share:.2f} for {topology.world_size} ranks on {cpu_count()} cores",
    )
    bandwidth = (calibration.link_bandwidth or 1e9) * share
    latency_us = (calibration.link_latency_s or 0.0) * 1e6
    links = dataclasses.replace(
        config.topology,
        intra_node_gbytes_per_s=bandwidth / 1e9,
        nic_gbits_per_s=bandwidth * 8 / 1e9,
        intra_node_latency_us=latency_us,
        inter_node_latency_us=latency_us,
    )
    config = dataclasses.replace(config, topology=links)
    topology = build_topology(links)
    batches = [
        request_lengths(config, topology, PlanRequest(batch=b)) for b in range(1, max(2, steps))
    ]
    if name in WEIGHTS_NAMES:
        return _predict_weights(config, WeightsMode(name), batches, rates, bandwidth)
    result = simulate_strategies(
        config, topology, batches, (name,), rates, config.train.tokens_per_rank
    )[name]
    if not result.steps:
        return None
    return result.step_seconds, result.tokens_per_second


def _predict_weights(config: Config, mode: WeightsMode, batches, rates, bandwidth):
    """(mean step seconds, tokens/s) of the weight-passing step model on these batches
    (fsdp and hsdp: its FSDP comparison); every device gets an equal share of each
    batch (rank packing balances tokens)."""
    if mode is WeightsMode.HSDP:
        mode = WeightsMode.FSDP  # the step model has no hybrid sharding
    if WEIGHTS_AXES[mode].passing is None and not WEIGHTS_AXES[mode].fsdp:
        return None
    topology = build_topology(config.topology)
    cluster = Hardware(topology, rates)
    shape = build_shape(config.model)
    share = 1.0 / topology.world_size
    steps = [
        simulate_step(
            mode,
            Workload(shape, tuple(int(n) for n in lengths), share, config.parallel.shard_recompute),
            cluster,
        )
        for lengths in batches
    ]
    seconds = sum(step.seconds for step in steps)
    tokens = sum(step.tokens for step in steps) * topology.world_size
    return seconds / len(steps), tokens / seconds


def format_table(rows: list[TrainBenchRow]) -> str:
    lines = [
        f"{'strategy':<26}{'measured k tok/s':>18}{'predicted k tok/s':>19}{'pred/meas':>11}"
        f"{'meas s/step':>13}{'pred s/step':>13}{'final loss':>12}"
    ]

    def fmt(value, scale=1.0, digits=2):
        return "-" if value is None else f"{value / scale:.{digits}f}"

    for r in rows:
        lines.append(
            f"{r.name:<26}{fmt(r.measured_tokens_per_second, 1e3):>18}"
            f"{fmt(r.predicted_tokens_per_second, 1e3):>19}{fmt(r.predicted_over_measured):>11}"
            f"{fmt(r.measured_step_seconds, 1, 3):>13}{fmt(r.predicted_step_seconds, 1, 3):>13}"
            f"{fmt(r.final_loss, 1, 4):>12}"
        )
    return "\n".join(lines)


def row_dicts(rows: list[TrainBenchRow]) -> list[dict]:
    return [
        {**dataclasses.asdict(r), "predicted_over_measured": r.predicted_over_measured}
        for r in rows
    ]
