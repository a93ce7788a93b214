"""The ideal step of a batch: the yardstick every simulated placement is measured against.

Every FLOP of the step spread evenly over the ranks at the rates it runs at when
nothing is split (each sequence's attention at the rate of its whole length, the
matmuls and element-wise work at theirs), with no communication exposed and no
rank waiting: the whole batch's compute / ranks, plus each rank's share of the
optimizer update and the step's fixed host work, which no placement can avoid.
A placement's step / ideal is then what its imbalance, its split blocks'
lower kernel rates and its exposed transfers cost together.
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition.work import WorkModel
from ray_zep.sim.step import RunModel, head_seconds


def ideal_step_seconds(lengths: np.ndarray, run: RunModel) -> float:
    """The ideal step of a batch of sequences of `lengths` under `run` (module docstring)."""
    hardware, shape = run.hardware, run.shape
    model = WorkModel.create(shape, hardware.topology, hardware.rates)
    lengths = np.asarray(lengths, dtype=np.int64)
    compute = float(model.whole_seconds(lengths).sum())
    compute += head_seconds(int(lengths.sum()), shape, hardware.rates)
    return compute / hardware.devices + fixed_seconds(run)


def fixed_seconds(run: RunModel) -> float:
    """What every placement pays besides its layers: the optimizer's share of the
    parameters on one rank and the step's fixed host work."""
    rates, world = run.hardware.rates, run.hardware.devices
    return run.shape.param_count() / world * rates.optimizer_param_seconds + rates.step_overhead_s
