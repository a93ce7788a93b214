"""Discrete-event core of the simulator: tasks on compute streams and shared links, with
dependencies.

A task on a compute lane holds a rank's compute stream for its whole duration: it
starts once all its dependencies have finished and the stream is free, and the stream
serves tasks first come, first served by the time they became ready (ties: the order the
tasks were added), as a CUDA stream does. A task on a link (a GPU's intra-node port in
one direction, a NIC in one direction) starts once its dependencies have finished and
shares its links with the others in flight there (`ray_zep.sim.link_sharing`). A task
with no resources and no duration is a join point: a host thread reaching a wait.

The messages of one exchange posted as a batch pay their latency side by side: the
engine posts a Ulysses all-to-all's (and the remap's all-to-all-v) sends and receives
together (`torch.distributed.batch_isend_irecv`, one NCCL group, whose operations progress
at once; NCCL's "Point-to-point communication" guide builds an all-to-all so), and a
NIC moves their bytes one after another while their latencies overlap. Such a message's
latency (`Task.latency`, part of its duration) holds no link: only its bytes share the
link, and the latency runs after them. Charged on the link with each message, a GPU of
a ring position of four nodes, sending 24 messages through the NIC it shares with
another GPU, took twice its bytes' time there (`bench scale`'s 7b chat batch at 1,024
GPUs: 1.0 ms, not 0.53, for the forward's output all-to-all). A ring hop, posted on its
own, holds its link for its whole duration (as `ray_zep.sim.ring_form` plays it).

Because a task is released only when its dependencies have finished, and its
successors become ready no earlier than it ends, tasks leave the ready queue in
non-decreasing ready time: one pass over a heap schedules the whole graph. The flows on
the same links have one entry there, for the first of them to end: booked anew when one
of them ends or joins, or when a start or an end on their links speeds them up; an entry
that a slowdown made early is booked again when it comes up.

On a CPU virtual cluster the ranks are processes sharing a few cores
(`CorePool`): a compute task's duration is its time while every rank computes,
and when some ranks wait (a ring stall, a rank with less work) the operating
system gives the others their cores, up to one core each. There the graph is
played event by event: between two events every running compute task advances at
the pool's speed for the number then running.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import numpy as np

from ray_zep.cycle_collection import without_cycle_collection
from ray_zep.sim.link_sharing import LinkFlows


class Lane(Enum):
    """Where a task is drawn on a rank's timeline."""

    COMPUTE = "compute"
    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"
    HOST = "host"
    """Join points and collectives' bookkeeping (not drawn)."""


_LINK_LANES = (Lane.INTRA_NODE, Lane.INTER_NODE)


class Task(NamedTuple):
    """One unit of work (a named tuple: a layer's graph holds hundreds of thousands).

    Attributes:
        name: what it is (for timelines and tests).
        rank: the rank it is drawn for (the sender of a transfer).
        lane: its lane.
        duration: seconds it holds its resources (on a link: its seconds with the
            link to itself, `ray_zep.sim.link_sharing`).
        resources: hashable resource names, held together.
        deps: indices of tasks that must finish first.
        latency: seconds of a flow's `duration` that delay its end without holding its
            links (a message's latency, after its bytes; module docstring).
    """

    name: str
    rank: int
    lane: Lane
    duration: float
    resources: tuple = ()
    deps: tuple[int, ...] = ()
    latency: float = 0.0


@dataclass(frozen=True)
class CorePool:
    """The cores the compute lanes of a CPU virtual cluster's ranks share.

    Attributes:
        ranks: processes computing on the cores.
        share: share of a core each rank gets while all of them compute, the share
            every compute task's duration was stated at (`Calibration.job_rates`).

    The pool holds `ranks * share` cores; a rank, one thread, takes at most one.
    """

    ranks: int
    share: float

    def __post_init__(self) -> None:
        if self.ranks < 1 or not 0.0 < self.share <= 1.0:
            raise ValueError(f"CorePool needs ranks >= 1 and 0 < share <= 1, got {self}")

    def speed(self, running: int) -> float:
        """How much faster than its stated duration each of `running` compute tasks runs."""
        return min(1.0, self.ranks * self.share / max(running, 1)) / self.share


@dataclass
class TaskGraph:
    """Tasks added in program order; indices are task ids.

    Attributes:
        tasks: the tasks.
        ahead: tasks of a collective for a later layer (a block gathered two or more
            ahead): nobody in this layer waits for them, and they may run past its end
            (`Timeline.makespan` leaves them out, `Timeline.overrun` is how far).
        spill: (task, share) of each link's part of the same collective posted a layer
            earlier, still running when this layer starts (`with_spill`).
        spill_wait: the task before them for what of that collective's ring steps'
            latency is left (no link held); None: no spill.
        spill_bytes: seconds the bytes of that collective take after its latency.
        slowed: seconds a compute task's duration holds beyond its work alone, while
            communication kernels share its device (`ComputeRates.contention`), by task.
    """

    tasks: list[Task] = field(default_factory=list)
    ahead: range = range(0)
    spill: list[tuple[int, float]] = field(default_factory=list)
    spill_wait: int | None = None
    spill_bytes: float = 0.0
    slowed: dict[int, float] = field(default_factory=dict)

    def with_spill(self, seconds: float) -> TaskGraph:
        """The graph with the collective posted a layer earlier running `seconds` into
        this one: its bytes' last `min(seconds, spill_bytes)` on each link (times the
        link's share), after what is left of its latency."""
        tasks = list(self.tasks)
        moved = min(seconds, self.spill_bytes)
        parts = [(index, moved * share) for index, share in self.spill]
        if self.spill_wait is not None:
            parts.append((self.spill_wait, seconds - moved))
        for index, duration in parts:
            t = tasks[index]
            tasks[index] = t._replace(duration=duration)
        return dataclasses.replace(self, tasks=tasks)

    def add(
        self,
        name: str,
        rank: int,
        lane: Lane,
        duration: float,
        resources: tuple = (),
        deps=(),
        latency: float = 0.0,
    ) -> int:
        if duration < 0:
            raise ValueError(f"task {name!r} has negative duration {duration}")
        latency = min(latency, duration)
        self.tasks.append(Task(name, rank, lane, duration, tuple(resources), _ids(deps), latency))
        return len(self.tasks) - 1

    def join(self, rank: int, deps) -> int:
        """A zero-length point after every task of `deps` (None entries are skipped)."""
        return self.add("join", rank, Lane.HOST, 0.0, (), deps)


def _ids(deps) -> tuple[int, ...]:
    ids = tuple(deps)
    return tuple(d for d in ids if d is not None) if None in ids else ids


@dataclass
class Timeline:
    """Start and end time of every task of a graph, seconds from 0."""

    graph: TaskGraph
    start: np.ndarray
    end: np.ndarray
    _by_lane: dict | None = field(default=None, repr=False, compare=False)

    @property
    def makespan(self) -> float:
        """When the layer's last task ends, a collective for a later layer aside."""
        ahead = self.graph.ahead
        if not ahead:
            return float(self.end.max()) if self.end.size else 0.0
        rest = np.concatenate([self.end[: ahead.start], self.end[ahead.stop :]])
        return float(rest.max()) if rest.size else 0.0

    @property
    def overrun(self) -> float:
        """How far the collective for a later layer (`TaskGraph.ahead`) runs past the
        layer's end; 0 if it ends within it."""
        ahead = self.graph.ahead
        if not ahead:
            return 0.0
        return max(0.0, float(self.end[ahead.start : ahead.stop].max()) - self.makespan)

    def intervals(self, rank: int, lane: Lane) -> list[tuple[float, float, str]]:
        """(start, end, name) of the rank's tasks on `lane`, by start time."""
        if self._by_lane is None:  # one pass over the tasks for every (rank, lane)
            self._by_lane = defaultdict(list)
            for i, t in enumerate(self.graph.tasks):
                if t.duration > 0:
                    self._by_lane[(t.rank, t.lane)].append(i)
        tasks = self.graph.tasks
        out = [
            (float(self.start[i]), float(self.end[i]), tasks[i].name)
            for i in self._by_lane.get((rank, lane), ())
        ]
        return sorted(out)

    def busy(self, rank: int, lane: Lane) -> float:
        """Seconds the rank's `lane` is busy (overlapping intervals counted once)."""
        total, reach = 0.0, 0.0
        for start, end, _ in self.intervals(rank, lane):
            if end > reach:
                total += end - max(start, reach)
                reach = end
        return total


@without_cycle_collection
def simulate(graph: TaskGraph, pool: CorePool | None = None) -> Timeline:
    """Schedule every task of `graph` (see the module docstring); with `pool`, the
    compute tasks share its cores.

    Raises:
        ValueError: a dependency names a later or unknown task (the graph must be
            built in program order, which also rules out cycles).
    """
    waiting, successors = _dependencies(graph)
    if pool is not None:
        return _simulate_shared(graph, pool, np.asarray(waiting), successors)
    tasks = graph.tasks
    count = len(tasks)
    # Python lists and floats: the loop reads and writes one task at a time
    durations = [t.duration for t in tasks]
    latencies = [t.latency for t in tasks]
    resources = [t.resources for t in tasks]
    flowing = [_is_flow(t) for t in tasks]
    ready_at = [0.0] * count
    start, end = [0.0] * count, [0.0] * count
    free: dict = {}
    flows = LinkFlows()
    # a group's entry on the heap: (when its first flow ends, -1 - group, version). A
    # group whose pace fell keeps its entry, now early, and is pushed again when it
    # comes up; one whose flow ended or whose pace rose gets a new entry.
    version: list[int] = []
    booked: list[float] = []  # when the group's live entry comes up; inf: none
    heap = [(0.0, index, 0) for index in range(count) if waiting[index] == 0]
    heapq.heapify(heap)
    pop, push, inf = heapq.heappop, heapq.heappush, float("inf")

    def repace(changed: list[int]) -> None:
        for group in changed:
            if group == len(version):
                version.append(0)
                booked.append(inf)
            at = flows.end(group)
            if at < booked[group]:
                version[group] += 1
                booked[group] = at
                push(heap, (at, -1 - group, version[group]))

    done = 0
    while heap:
        begin, index, seen = pop(heap)
        if index < 0:  # a group's first flow ends, unless the group changed since
            group = -1 - index
            if seen != version[group]:
                continue
            at = flows.end(group)
            if at > begin:  # its pace fell since it was booked
                booked[group] = at
                push(heap, (at, index, seen))
                continue
            booked[group] = inf
            index, changed = flows.finish(group, begin)
            repace(changed)
            finish = begin + latencies[index]
        elif flowing[index]:
            start[index] = begin
            bytes_s = durations[index] - latencies[index]
            repace(flows.start(index, resources[index], bytes_s, begin))
            continue
        else:
            held = resources[index]
            for resource in held:
                at = free.get(resource, 0.0)
                if at > begin:
                    begin = at
            finish = begin + durations[index]
            for resource in held:
                free[resource] = finish
            start[index] = begin
        end[index] = finish
        done += 1
        for succ in successors[index]:
            if ready_at[succ] < finish:
                ready_at[succ] = finish
            left = waiting[succ] - 1
            waiting[succ] = left
            if not left:
                push(heap, (ready_at[succ], succ, 0))
    if done != count:
        raise ValueError(f"{count - done} tasks never became ready")
    return Timeline(graph, np.asarray(start), np.asarray(end))


def _is_flow(task: Task) -> bool:
    """The task moves bytes on links it shares (`ray_zep.sim.link_sharing`)."""
    return (task.lane in _LINK_LANES and task.duration > task.latency
            and bool(task.resources))  # fmt: skip


def _dependencies(graph: TaskGraph) -> tuple[list[int], list[list[int]]]:
    """(count of unfinished dependencies, successors) of every task."""
    tasks = graph.tasks
    waiting = [len(task.deps) for task in tasks]
    successors: list[list[int]] = [[] for _ in tasks]
    for index, task in enumerate(tasks):
        for dep in task.deps:
            if not 0 <= dep < index:
                raise ValueError(f"task {index} ({task.name}) depends on task {dep}")
            successors[dep].append(index)
    return waiting, successors


def _simulate_shared(
    graph: TaskGraph, pool: CorePool, waiting: np.ndarray, successors: list[list[int]]
) -> Timeline:
    """`simulate` with the compute tasks sharing `pool`, event by event. At each event
    the ready tasks are offered their resources by ready time (ties: program order); a
    compute task that cannot start holds back its stream from later tasks, as a
    reservation does in the one-pass schedule; a flow starts at once and shares its
    links (`ray_zep.sim.link_sharing`)."""
    tasks = graph.tasks
    count = len(tasks)
    start, end = np.zeros(count), np.zeros(count)
    ready: list[tuple[float, int]] = [(0.0, i) for i in range(count) if waiting[i] == 0]
    held: set = set()
    fixed: list[tuple[float, int]] = []  # (end, task) of tasks of a set duration
    shared: dict[int, float] = {}  # running compute task -> seconds left at speed 1
    flows = LinkFlows()
    now, done = 0.0, 0

    def finish(index: int) -> None:
        nonlocal done
        end[index] = now
        done += 1
        held.difference_update(tasks[index].resources)
        for succ in successors[index]:
            waiting[succ] -= 1
            if waiting[succ] == 0:
                ready.append((now, succ))

    while done < count:
        ready.sort()
        blocked: set = set()
        not_started = []
        for entry in ready:
            index = entry[1]
            task = tasks[index]
            if _is_flow(task):
                start[index] = now
                flows.start(index, task.resources, task.duration - task.latency, now)
                continue
            if any(r in held or r in blocked for r in task.resources):
                blocked.update(task.resources)
                not_started.append(entry)
                continue
            start[index] = now
            held.update(task.resources)
            if task.lane is Lane.COMPUTE and task.duration > 0:
                shared[index] = task.duration
            else:
                heapq.heappush(fixed, (now + task.duration, index))
        ready[:] = not_started
        speed = pool.speed(len(shared))
        step = min(shared.values(), default=np.inf) / speed
        moving, group = flows.soonest()
        upcoming = min(now + step, fixed[0][0] if fixed else np.inf, moving)
        if upcoming == np.inf:
            raise ValueError(f"{count - done} tasks never became ready")
        elapsed = upcoming - now
        now = upcoming
        for index in list(shared):
            shared[index] -= elapsed * speed
            if shared[index] <= 1e-12 * tasks[index].duration:
                del shared[index]
                finish(index)
        while moving <= now:
            index = flows.finish(group, now)[0]
            latency = tasks[index].latency
            if latency > 0:  # its bytes have moved; its latency holds no link
                heapq.heappush(fixed, (now + latency, index))
            else:
                finish(index)
            moving, group = flows.soonest()
        while fixed and fixed[0][0] <= now:
            finish(heapq.heappop(fixed)[1])
    return Timeline(graph, start, end)
