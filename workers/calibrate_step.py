"""The fixed cost of a training step on a CPU virtual cluster, measured through Ray.

Besides its layers, a step on every rank fetches its shard from the data actor,
clips the gradients (an all-reduce of their norm), updates, accounts the step
(modelled memory, FLOPs, traffic) and all-reduces its totals, while the driver
and the data actor share the same cores. On a virtual cluster these host-side
parts cost tens of milliseconds. Here the configured cluster trains the
configured model through the Ray driver, as `ray-zep train` does, on batches of
32 tokens per rank with whole sequences and replicated weights; the step time
beyond what the simulator models for those steps (`ray_zep.sim.step`) is the
fixed cost it adds to every step it simulates on this machine
(`ComputeRates.step_overhead_s`). The same steps with FSDP2 give what each of
its units adds on the host (its hooks, the copies into and out of the gathered
buffers: `ComputeRates.fsdp_unit_overhead_s`).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np

from ray_zep import steplog
from ray_zep.bench.calibrate import Calibration
from ray_zep.config import load_config
from ray_zep.constants import METRICS_FILE_NAME
from ray_zep.model.shapes import build_shape
from ray_zep.parallel.axes import WeightsMode
from ray_zep.parallel.memory import fsdp_units
from ray_zep.sim.replay import replay

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
STEPS = 8
WARM_UP = 2
"""Steps left out (process groups, first plans, allocator)."""


def measure_step_overhead(
    config_path: str | None, overrides: list[str], calibration: Calibration, out: Path
) -> Calibration:
    """`calibration` with `rates.step_overhead_s` and `rates.fsdp_unit_overhead_s` measured
    (module docstring): tiny steps with replicated weights, then with FSDP2."""
    plain = out / WeightsMode.REPLICATED.value
    overhead = _overhead(config_path, [*overrides, *TINY_STEPS], calibration, plain)
    rates = dataclasses.replace(calibration.rates, step_overhead_s=overhead)
    calibration = dataclasses.replace(calibration, rates=rates)
    sharded = [*overrides, *TINY_STEPS, f"parallel.weights={WeightsMode.FSDP.value}"]
    extra = _overhead(config_path, sharded, calibration, out / WeightsMode.FSDP.value)
    config = load_config(config_path, sharded)
    units = len(fsdp_units(build_shape(config.model), config.parallel.fsdp_unit))
    rates = dataclasses.replace(calibration.rates, fsdp_unit_overhead_s=extra / units)
    return dataclasses.replace(calibration, rates=rates)


def _overhead(
    config_path: str | None, overrides: list[str], calibration: Calibration, out: Path
) -> float:
    """Seconds a tiny step takes beyond what `calibration` simulates for it."""
    from workers.driver import train

    shutil.rmtree(out, ignore_errors=True)  # a fresh run, never a resume
    extra = [f"train.steps={STEPS}", f"train.out_dir={out}"]
    config = load_config(config_path, [*overrides, *extra])
    summary = train(config)
    rows = steplog.step_rows(summary.run_dir / METRICS_FILE_NAME)[WARM_UP:]
    measured = float(np.mean([r["step_seconds"] for r in rows]))
    hardware = calibration.hardware(config.topology)
    simulated = replay(config, hardware, WARM_UP, STEPS - WARM_UP, on_gpu=False)
    return max(0.0, measured - simulated.step_seconds)
