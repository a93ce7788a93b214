"""Why a rank's compute stream stands idle in a simulated layer: transfers or waits.

A gap on a rank's compute lane ends when its next compute task starts, and that task
started once the last of its dependencies had finished. Following that chain back (join
points have no length), every stretch of the gap is charged to the task that held it up:

- a message or a collective on a link (moving at its share of the links it shares
  with others, `ray_zep.sim.link_sharing`), or a collective's latency: an *exposed
  transfer*;
- another rank's compute, or a task with no dependency left to follow: a *wait* (a
  slower ring peer, a rank behind in the layer).

After the rank's own last task the layer waits for its slowest rank: a wait too. The
two add up to the layer's makespan less the rank's compute. A gather posted for a later
layer (`TaskGraph.ahead`) is not the rank's task here: it may end after the layer does.
"""

from __future__ import annotations

import numpy as np

from ray_zep.sim.events import Lane, Task, Timeline

TRANSFERS = "transfers"
WAITS = "waits"
_TRANSFER_LANES = (Lane.INTRA_NODE, Lane.INTER_NODE)


def idle_causes(timeline: Timeline, rank: int) -> dict[str, float]:
    """Seconds `rank`'s compute lane is idle within the layer's makespan, by cause
    (`TRANSFERS`, `WAITS`; module docstring)."""
    tasks, start, end = timeline.graph.tasks, timeline.start, timeline.end
    mine = np.fromiter((t.rank == rank for t in tasks), bool, len(tasks))
    ahead = timeline.graph.ahead
    mine[ahead.start : ahead.stop] = False  # a gather for a later layer: not this one's
    own = np.flatnonzero(mine)
    computes = [int(i) for i in own if tasks[i].lane is Lane.COMPUTE and tasks[i].duration > 0]
    computes.sort(key=lambda i: start[i])
    out = {TRANSFERS: 0.0, WAITS: 0.0}
    reach = 0.0
    for i in computes:
        if start[i] > reach:
            _charge(timeline, i, reach, float(start[i]), out)
        reach = max(reach, float(end[i]))
    if own.size:
        last = int(own[np.argmax(end[own])])
        if end[last] > reach:
            _charge(timeline, last, reach, float(end[last]), out)
            reach = float(end[last])
    out[WAITS] += max(0.0, timeline.makespan - reach)
    return out


def _charge(timeline: Timeline, task: int, low: float, high: float, out: dict) -> None:
    """Charges [low, high), which ends no later than `task` does, to what held it up."""
    tasks, start, end = timeline.graph.tasks, timeline.start, timeline.end
    while high > low:
        t = tasks[task]
        if t.duration > 0:  # its own run
            running = max(low, float(start[task]))
            if high > running:
                out[_cause(t)] += high - running
                high = running
            if high <= low:
                return
        blocking = max(t.deps, key=lambda d: end[d]) if t.deps else None
        ready = float(end[blocking]) if blocking is not None else 0.0
        if ready < high:  # ready, but its resources were busy
            queued = max(low, ready)
            out[_cause(t)] += high - queued
            high = queued
        if blocking is None:
            out[WAITS] += max(0.0, high - low)
            return
        task = blocking


def _cause(task: Task) -> str:
    if task.lane in _TRANSFER_LANES or (task.lane is Lane.HOST and task.duration > 0):
        return TRANSFERS
    return WAITS
