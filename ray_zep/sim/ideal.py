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
    compute, fixed = ideal_parts(lengths, run)
    return compute + fixed


def ideal_parts(lengths: np.ndarray, run: RunModel) -> tuple[float, float]:
    """(the batch's compute spread evenly over the ranks at unsplit rates, the
    optimizer's share and the step's fixed work) in seconds."""
    hardware, shape = run.hardware, run.shape
    rates, world = hardware.rates, hardware.devices
    model = WorkModel.create(shape, hardware.topology, rates)
    lengths = np.asarray(lengths, dtype=np.int64)
    compute = float(model.whole_seconds(lengths).sum())
    compute += head_seconds(int(lengths.sum()), shape, rates)
    optimizer = shape.param_count() / world * rates.optimizer_param_seconds
    return compute / world, optimizer + rates.step_overhead_s
