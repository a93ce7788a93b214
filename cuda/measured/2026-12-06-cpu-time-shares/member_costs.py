"""The planner's modelled work of each rank (`WorkModel`, summed over its queue items) against
the simulated layers it computes to its last task (forward + backward, every layer), by what
the rank holds, for some rows of a replay record (the kept variant of each).

Usage: python member_costs.py RECORD.json GPUS:DATA:MODEL [...]
"""

import sys
from pathlib import Path

import numpy as np

import ray_zep.bench.scale as scale
import ray_zep.bench.scale_play as play
from ray_zep.bench.scale_replay import recorded_rows, replay
from ray_zep.partition.work import RingParts, WorkModel
from ray_zep.sim.events import Lane
from ray_zep.topology import LinkKind

captured = []
simulated = play.simulated_step


def capture(*args, **kwargs):
    result = simulated(*args, **kwargs)
    captured.append((args, result))
    return result


play.simulated_step = capture
if hasattr(scale, "simulated_step"):
    scale.simulated_step = capture


def summed(parts):
    return RingParts(parts.diagonal_s.sum(), parts.step_s.sum(), parts.send_bytes.sum())


def modelled(plan, run):
    topology = run.hardware.topology
    gpus = topology.gpus_per_node
    model = WorkModel.create(run.shape, topology, run.hardware.rates,
                             routed=run.config.parallel.routing, capacity=plan.tokens_per_rank)
    lengths = plan.lengths.astype(np.float64)
    work, kind = np.zeros(plan.world), [""] * plan.world
    for item in plan.items():
        n = lengths[list(item.seqs)]
        ranks = list(item.ranks)
        if len(ranks) == 1:
            work[ranks] += model.whole_seconds(n).sum()
            what = "local"
        elif item.ulysses > 1:
            positions, u = item.ring_size, item.ulysses
            parts = summed(model.ring_parts(n, np.full(n.size, positions)))
            work[ranks] += model.usp_group_seconds(parts, n.sum(), positions, 0 if u == gpus else u)
            what = f"usp U{u}"
        else:
            degree = len(ranks)
            link = LinkKind.INTER_NODE if item.zone.name == "INTER_NODE" else LinkKind.INTRA_NODE
            parts = summed(model.ring_parts(n, np.full(n.size, degree)))
            work[ranks] += model.ring_member_seconds(parts, n.sum() / degree, degree, link)
            what = "ring " + ("inter" if link is LinkKind.INTER_NODE else "intra")
        for rank in ranks:
            kind[rank] = f"{kind[rank]}+{what}" if kind[rank] else what
    return work, np.array([k or "empty" for k in kind])


def last_compute(timeline, world):
    last = np.zeros(world)
    for i, task in enumerate(timeline.graph.tasks):
        if task.lane is Lane.COMPUTE and task.duration > 0:
            last[task.rank] = max(last[task.rank], timeline.end[i])
    return last


wanted = {tuple(arg.split(":")) for arg in sys.argv[2:]}
rows = [row for row in recorded_rows(Path(sys.argv[1]), ("zeppelin",))
        if (str(row["gpus"]), row["distribution"], row["model"]) in wanted]
for row in rows:
    captured.clear()
    replay([row], (), progress=lambda line: None)
    args, kept = min(captured[len(captured) // 2 :], key=lambda c: c[1].step_seconds / c[1].tokens)
    run, plan = args[1], kept.plan
    work, kind = modelled(plan, run)
    layers = run.shape.n_layers
    played = layers * (last_compute(kept.forward, plan.world) + last_compute(kept.backward, plan.world))
    slowest = layers * (kept.forward.makespan + kept.backward.makespan)
    print(f"{row['gpus']} {row['distribution']} {row['model']}: modelled busiest / mean "
          f"{work.max() / work.mean():.3f}")
    for what in sorted(set(kind) - {"empty"}):
        at = kind == what
        ratio = played[at] / work[at]
        print(f"  {what:22s} ranks {at.sum():5d}  modelled / busiest modelled "
              f"{work[at].mean() / work.max():.3f}  played / slowest {played[at].mean() / slowest:.3f}"
              f"  played / modelled {ratio.mean():.3f} ({ratio.min():.3f}-{ratio.max():.3f})")
