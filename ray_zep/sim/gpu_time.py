"""Where a simulated step's GPU-time goes: every rank's forward and backward layers, each
as long as the layer's slowest rank makes it, split four ways.

- computing: the rank's compute tasks;
- waiting for the slowest: after the rank's last compute task, until the layer ends (a
  rank holding nothing: the whole layer);
- idle in its ring: between the rank's first and last ring step (`RING_STEP`), not
  computing: the steps' waits on their K/V and on slower peers (a ring the simulator
  plays on arrays, `ray_zep.sim.ring_form`, is one task a member: its waits count as
  computing there, as in `ray_zep.sim.bound.over_bound`);
- other: the rest (the Ulysses and remap exchanges, the weights' collectives a rank waits
  on before or between its tasks).

The shares add up to 1. Where `over_bound` charges the busiest rank's time over the
bound, these count every rank's: on `bench scale`'s 4k grid (64-1,024 GPUs) the ranks
compute 0.886 of their GPU-time and wait for the layer's slowest rank 0.080 of it
(BENCHMARKS.md, sixty-fourth series).
"""

from __future__ import annotations

import numpy as np

from ray_zep.sim.events import Lane, Timeline
from ray_zep.sim.graph_builder import RING_STEP
from ray_zep.sim.step import StepResult

SHARES = ("computing", "waiting for the slowest", "idle in its ring", "other")


def mean_gpu_time_shares(steps, world: int) -> dict[str, float] | None:
    """`gpu_time_shares` of several batches' `steps`, each share's mean over them; None
    where there are none or any step has none."""
    shares = [gpu_time_shares(step, world) for step in steps]
    if not shares or any(one is None for one in shares):
        return None
    return {name: float(np.mean([one[name] for one in shares])) for name in SHARES}


def gpu_time_shares(step: StepResult, world: int) -> dict[str, float] | None:
    """`SHARES` of the step's layers over `world` ranks (module docstring), a step of
    several micro-batches (`StepResult.micro_steps`) over all of theirs; None where a
    step has no layer timelines, or they are not the whole step's (several plans' layers
    summed, as in the baselines' waves and scheduled micro-batches)."""
    parts = [_step_seconds(one, world) for one in step.micro_steps or (step,)]
    if any(part is None for part in parts):
        return None
    seconds = sum(part[0] for part in parts)
    total = sum(part[1] for part in parts)
    if total <= 0:
        return None
    return {name: float(value / total) for name, value in zip(SHARES, seconds, strict=True)}


def _step_seconds(step: StepResult, world: int) -> tuple[np.ndarray, float] | None:
    """Rank-seconds of one plan's layers by `SHARES`, and all of them together."""
    if not step.timelines_whole:
        return None
    seconds = _layer_seconds(step.forward, world) + _layer_seconds(step.backward, world)
    return seconds, world * (step.forward.makespan + step.backward.makespan)


def _layer_seconds(timeline: Timeline, world: int) -> np.ndarray:
    """Rank-seconds of one layer by `SHARES`."""
    tasks = timeline.graph.tasks
    count = len(tasks)
    rank = np.fromiter((t.rank for t in tasks), np.int64, count)
    computes = np.fromiter((t.lane is Lane.COMPUTE and t.duration > 0 for t in tasks), bool,
                           count)  # fmt: skip
    steps = computes & np.fromiter((t.name.startswith(RING_STEP) for t in tasks), bool, count)
    length = timeline.end - timeline.start
    makespan = timeline.makespan
    busy = np.bincount(rank[computes], weights=length[computes], minlength=world)
    last = np.zeros(world)
    np.maximum.at(last, rank[computes], timeline.end[computes])
    first_step = np.full(world, np.inf)
    last_step = np.zeros(world)
    np.minimum.at(first_step, rank[steps], timeline.start[steps])
    np.maximum.at(last_step, rank[steps], timeline.end[steps])
    in_steps = np.bincount(rank[steps], weights=length[steps], minlength=world)
    ringed = np.isfinite(first_step)
    ring_idle = np.where(ringed, last_step - np.where(ringed, first_step, 0.0) - in_steps, 0.0)
    waiting = makespan - last
    other = world * makespan - busy.sum() - waiting.sum() - ring_idle.sum()
    return np.array([busy.sum(), waiting.sum(), ring_idle.sum(), other])
