"""Where each replayed row's GPU-time goes, over all ranks of its forward and backward layer
timelines (the kept variant of each row: the most tokens, then the shortest step).

busy: compute tasks; tail: after a rank's last compute task, waiting for the layer's
slowest rank (empty ranks: their whole layer); ring idle: between a rank's first and last
attention ring step, not computing; other: the rest (exchanges, remap, weights before
the first compute task or between tasks outside the ring).

Usage: python time_shares.py RECORD.json [key=value ...]
"""

import sys
from pathlib import Path

import numpy as np

import ray_zep.bench.scale as scale
import ray_zep.bench.scale_play as play
from ray_zep.bench.scale_replay import recorded_rows, replay
from ray_zep.sim.events import Lane

captured = []
simulated = play.simulated_step


def capture(*args, **kwargs):
    result = simulated(*args, **kwargs)
    captured.append(result)
    return result


play.simulated_step = capture
if hasattr(scale, "simulated_step"):
    scale.simulated_step = capture


def shares(timeline, world):
    busy, last = np.zeros(world), np.zeros(world)
    ring = {}
    for i, task in enumerate(timeline.graph.tasks):
        if task.lane is not Lane.COMPUTE or task.duration <= 0:
            continue
        start, end = timeline.start[i], timeline.end[i]
        busy[task.rank] += end - start
        last[task.rank] = max(last[task.rank], end)
        if task.name.startswith("attention step"):
            span = ring.setdefault(task.rank, [start, end, 0.0])
            span[0], span[1] = min(span[0], start), max(span[1], end)
            span[2] += end - start
    span = timeline.makespan
    tail = span - last
    ring_idle = np.zeros(world)
    for rank, (start, end, computing) in ring.items():
        ring_idle[rank] = max(0.0, end - start - computing)
    other = span - busy - tail - ring_idle
    return np.array([busy.sum(), tail.sum(), ring_idle.sum(), other.sum()]) / world, span


rows = recorded_rows(Path(sys.argv[1]), ("zeppelin",))
totals = []
print("GPUs data model | busy tail ring_idle other (shares of GPU-time)")
for row in rows:
    captured.clear()
    replay([row], tuple(sys.argv[2:]), progress=lambda line: None)
    kept = min(captured[len(captured) // 2 :], key=lambda r: r.step_seconds / r.tokens)
    world = kept.plan.world
    forward, forward_s = shares(kept.forward, world)
    backward, backward_s = shares(kept.backward, world)
    share = (forward + backward) / (forward_s + backward_s)
    totals.append(share)
    print(row["gpus"], row["distribution"], row["model"], "|", " ".join(f"{x:.3f}" for x in share),
          flush=True)
print("mean |", " ".join(f"{x:.4f}" for x in np.mean(totals, axis=0)))
