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

Shapes: F flows in flight.
"""

from __future__ import annotations

from collections import defaultdict


class LinkFlows:
    """The flows in flight: what each has left to move (seconds at a whole link), its
    pace, and since when that pace holds."""

    def __init__(self) -> None:
        self.on: dict = defaultdict(set)  # resource -> flows using it
        self.links: dict[int, tuple] = {}
        self.left: dict[int, float] = {}
        self.pace: dict[int, float] = {}
        self.since: dict[int, float] = {}

    def start(self, index: int, resources: tuple, seconds: float, now: float) -> list[int]:
        """Adds a flow of `seconds` alone on `resources` at `now`; returns the flows
        whose pace changed (it among them)."""
        near = self._neighbours(resources)
        self.links[index] = resources
        self.left[index], self.since[index] = seconds, now
        for resource in resources:
            self.on[resource].add(index)
        if not near:  # alone on its links
            self.pace[index] = 1.0
            return [index]
        self.pace[index] = self._pace_of(index)
        return [index, *self._repace(near, now)]

    def finish(self, index: int, now: float) -> list[int]:
        """Removes a flow that has moved everything; returns the flows whose pace changed."""
        resources = self.links.pop(index)
        for resource in resources:
            self.on[resource].discard(index)
        del self.left[index], self.pace[index], self.since[index]
        return self._repace(self._neighbours(resources), now)

    def end(self, index: int) -> float:
        """When the flow ends at its present pace."""
        return self.since[index] + max(self.left[index], 0.0) / self.pace[index]

    def settle_all(self, now: float) -> None:
        """Brings every flow's bytes left up to `now`."""
        for index in self.left:
            self.left[index] -= self.pace[index] * (now - self.since[index])
            self.since[index] = now

    def _neighbours(self, resources: tuple) -> set[int]:
        near: set[int] = set()
        on = self.on
        for resource in resources:
            if resource in on:
                near |= on[resource]
        return near

    def _pace_of(self, index: int) -> float:
        most, on = 1, self.on
        for resource in self.links[index]:
            count = len(on[resource])
            if count > most:
                most = count
        return 1.0 / most

    def _repace(self, flows, now: float) -> list[int]:
        """The flows among `flows` whose pace a start or an end changed, their bytes left
        brought up to `now` at the pace they had."""
        changed = []
        pace_of, paces, left, since = self._pace_of, self.pace, self.left, self.since
        for index in flows:
            pace, was = pace_of(index), paces[index]
            if pace != was:
                left[index] -= was * (now - since[index])
                since[index], paces[index] = now, pace
                changed.append(index)
        return changed
