"""Messages and collectives sharing links, as a NIC serves the queue pairs of several
kernels at once and a GPU's port the copies posted on it.

A task on a link lane (`Lane.INTRA_NODE`, `Lane.INTER_NODE`) is a flow: it starts as
soon as its dependencies have finished, and its `duration` is its time with its links to
itself. While k flows use one direction of a link, each moves at 1 / k of that link's
bandwidth; a flow naming two link directions (the sender's NIC out, the receiver's NIC
in) moves at the pace of the busier one. So a short message posted beside a collective's
run or a ring's large block does not wait for all of it, nor is the large one held back
behind a stream of short ones: each finishes when its bytes have moved at its share.
(A flow held back by its busier link leaves part of the other unused: the simple rule
undercounts what the other flows there could move, never overcounts a link's bytes.)

Flows naming the same links always move at one pace, so they are kept as one *lane
group* with a clock: the seconds at a whole link each of its flows has moved since the
group began. A flow ends when the clock reaches its start reading plus its seconds, so
a start or an end re-paces each group on its links once, however many flows the group
holds (an all-to-all posts several messages on one pair of NICs).

Shapes: G groups, F flows in flight.
"""

from __future__ import annotations

import heapq
from collections import defaultdict


class LinkFlows:
    """The flows in flight, in groups by the links they name: each group's pace, its
    clock and since when that pace holds, and its flows by the clock reading they end
    at."""

    def __init__(self) -> None:
        self.group_of: dict[tuple, int] = {}  # links -> group
        self.links: list[tuple] = []
        self.pace: list[float] = []
        self.clock: list[float] = []
        self.since: list[float] = []
        self.due: list[list[tuple[float, int]]] = []  # (clock reading at its end, flow)
        self.on: dict = defaultdict(set)  # resource -> groups with flows in flight there
        self.count: dict = defaultdict(int)  # resource -> flows in flight there

    def start(self, index: int, resources: tuple, seconds: float, now: float) -> list[int]:
        """Adds flow `index` of `seconds` alone on `resources` at `now`; returns its
        group's id, then the groups whose pace rose (those whose pace fell end later
        than they were due: their caller finds that out when they come up)."""
        group = self.group_of.get(resources)
        if group is None:
            group = self.group_of[resources] = len(self.links)
            self.links.append(resources)
            self.pace.append(1.0)
            self.clock.append(0.0)
            self.since.append(now)
            self.due.append([])
        due = self.due[group]
        if due:
            self.clock[group] += self.pace[group] * (now - self.since[group])
        self.since[group] = now
        heapq.heappush(due, (self.clock[group] + seconds, index))
        count, on = self.count, self.on
        for resource in resources:
            count[resource] += 1
            on[resource].add(group)
        return [group, *self._repace(resources, now)]

    def finish(self, group: int, now: float) -> tuple[int, list[int]]:
        """Ends the group's first flow to end, at `now`; returns it and the groups whose
        pace rose (the group first, if it still has flows)."""
        due = self.due[group]
        index = heapq.heappop(due)[1]
        resources, count, on = self.links[group], self.count, self.on
        for resource in resources:
            count[resource] -= 1
            if not due:
                on[resource].discard(group)
        risen = self._repace(resources, now)
        return index, [group, *risen] if due else risen

    def end(self, group: int) -> float:
        """When the group's first flow ends at the present pace."""
        ahead = self.due[group][0][0] - self.clock[group]
        return self.since[group] + max(ahead, 0.0) / self.pace[group]

    def soonest(self) -> tuple[float, int]:
        """(end, group) of the flow in flight that ends first; (inf, -1) if none."""
        ends = [(self.end(group), group) for group, due in enumerate(self.due) if due]
        return min(ends, default=(float("inf"), -1))

    def _repace(self, resources: tuple, now: float) -> list[int]:
        """Re-paces the groups on `resources` after a start or an end there, their
        clocks brought up to `now` at the pace they had; returns those whose pace rose."""
        near: set[int] = set()
        on = self.on
        for resource in resources:
            near |= on[resource]
        risen = []
        count, links, paces = self.count, self.links, self.pace
        clock, since = self.clock, self.since
        for group in near:
            most = 1
            for resource in links[group]:
                held = count[resource]
                if held > most:
                    most = held
            pace, was = 1.0 / most, paces[group]
            if pace != was:
                clock[group] += was * (now - since[group])
                since[group], paces[group] = now, pace
                if pace > was:
                    risen.append(group)
        return risen
