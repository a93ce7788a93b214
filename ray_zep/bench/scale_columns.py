"""The columns `bench scale` fills from a row's plans and simulated steps: the level its
plans kept, and the step against its ideal and bound with where the time over the bound
goes."""

from __future__ import annotations

import numpy as np

from ray_zep.partition.level_trace import LevelOutcome
from ray_zep.sim.bound import over_bound
from ray_zep.sim.gpu_time import mean_gpu_time_shares
from ray_zep.sim.phase_setter import phase_setters


def level_columns(plans, world: int) -> tuple[float | None, float | None, float | None]:
    """(the level kept, the ranks the rings need at the mean level over `world`, the kept
    level's ring members' mean work over it) of a step's one plan (`ScaleRow.level`,
    `rings_at_mean`, `ring_fill`); None where not known."""
    if len(plans) != 1:
        return None, None, None
    levels = plans[0].levels
    kept = next((t for t in levels if t.outcome is LevelOutcome.KEPT), None)
    at_mean = next((t.ranks for t in levels if t.factor == 1.0 and t.ranks), None)
    fill = None if kept is None or not kept.ring_ranks else kept.ring_fill
    return (None if kept is None else kept.factor, None if at_mean is None else at_mean / world,
            fill)  # fmt: skip


def simulated_columns(row, steps, ideal, bounds, n_layers: int) -> float:
    """Fills the simulated columns of `row` (a `ray_zep.bench.scale.ScaleRow`); returns the
    steps' seconds together."""
    seconds = np.asarray([s.step_seconds for s in steps])
    row.step_s = float(seconds.mean())
    row.step_over_ideal = float(np.mean(seconds / np.asarray(ideal)))
    row.step_over_bound = float(np.mean(seconds / np.asarray([b.seconds for b in bounds])))
    parts = [over_bound(s, b, n_layers) for s, b in zip(steps, bounds, strict=True)]
    if all(p is not None for p in parts):
        row.imbalance_s = float(np.mean([p["imbalance"] for p in parts]))
        row.split_kernels_s = float(np.mean([p["split kernels"] for p in parts]))
        row.contention_s = float(np.mean([p["contention"] for p in parts]))
        row.transfers_s = float(np.mean([p["exposed transfers"] for p in parts]))
        row.waits_s = float(np.mean([p["waits"] for p in parts]))
        row.recompute_s = float(np.mean([p["recompute"] for p in parts]))
    row.gpu_time = mean_gpu_time_shares(steps, row.gpus)
    row.phase_ends = [setter.to_dict() for setter in phase_setters(steps[0])]
    return float(seconds.sum())
