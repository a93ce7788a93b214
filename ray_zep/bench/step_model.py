"""The simulator's view of a `ray-zep bench step` case: the step `ray_zep.sim` models for
the same shards on one GPU of the device's preset rates, and what backward recomputes in
it (`StepResult.recompute_seconds`) under the case's activation checkpointing.

The bench sets these beside what the device measured, so that the rates the cluster rows
of `bench scale` are built from (their compute, and the recomputation the 16k-token rows
pay to fit) are checked on the GPU they name. A device with no preset (a CPU, an unknown
GPU) has no modelled step: the figures are NaN.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass

import numpy as np

from ray_zep.config import Config
from ray_zep.costmodel import known_rates
from ray_zep.errors import ZepError
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel, simulate_batch
from ray_zep.topology import build_topology

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelledStep:
    """Mean modelled seconds over a case's steps."""

    step_seconds: float
    recompute_seconds: float

    @classmethod
    def unknown(cls) -> ModelledStep:
        return cls(math.nan, math.nan)


def modelled_step(config: Config, device_name: str, batches: list[list[int]]) -> ModelledStep:
    """The modelled step of `config` (one rank) on each batch of sequence lengths, at the
    preset rates of `device_name`, averaged over the batches.

    Args:
        config: the case's config (one node of one GPU, as `bench step` trains it).
        device_name: the device's name (`torch.cuda.get_device_name`; "CPU" has none).
        batches: the sequence lengths of each step's shard.
    """
    rates = known_rates(device_name)
    if not batches or rates is None:
        return ModelledStep.unknown()
    run = RunModel.create(config, Hardware(build_topology(config.topology), rates))
    try:
        results = [simulate_batch(np.asarray(lengths, dtype=np.int64), run) for lengths in batches]
    except ZepError as error:  # the measured row stands; the model cannot play this case
        log.warning("bench step: no modelled step for this case: %s", error)
        return ModelledStep.unknown()
    return ModelledStep(
        statistics.mean(r.step_seconds for r in results),
        statistics.mean(r.recompute_seconds for r in results),
    )
