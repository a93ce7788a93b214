"""Which GPUs each ring of a level takes (`ray_zep.partition.balance`).

A ring of D > G ranks (G GPUs per node) takes D // G whole nodes and its rest, D % G
ranks, on one more node; a ring of at most G ranks lies inside one node. The whole
nodes go first, for every ring; the rests and the intra-node rings are then packed
best fit decreasing, each into the node with the fewest free GPUs that hold it, so
that the GPUs a rest leaves free on its node serve the small rings.

An inter-node ring's hops over a node's NICs are shared with every other inter-node
ring crossing that node, so a rest goes, in this order:

1. to a node that no other inter-node ring crosses (an empty one, where no node with
   fewer free GPUs has room);
2. to one that fewer than `MAX_CROSSING` rings cross;
3. nowhere: the level is infeasible (`force`: the best fit among all nodes, else the
   nodes with most free GPUs).

The work model costs a ring's hops at the node's whole NIC bandwidth; the simulator
counts the sharing. Rounding every inter-node ring up to whole nodes instead left up
to G - 1 ranks of each idle: on `bench scale`'s prolong64k batches 12-20% of the step.
"""

from __future__ import annotations

import bisect

import numpy as np

MAX_CROSSING = 2
"""Most inter-node rings whose hops share one node's NICs: with a third, the exposed
transfers of `bench scale`'s 1,024-GPU prolong64k rows grew 2-3x."""


class NodeSlots:
    """Free GPUs of every node, and the inter-node rings crossing each."""

    def __init__(self, nodes: int, gpus: int) -> None:
        self.gpus = gpus
        self.free = [list(range(n * gpus, (n + 1) * gpus)) for n in range(nodes)]
        self.count = np.full(nodes, gpus, dtype=np.int64)
        self.crossing = np.zeros(nodes, dtype=np.int64)
        """Inter-node rings with members on each node."""
        self._by_free: list[list[int]] = [[] for _ in range(gpus)] + [list(range(nodes))]
        """Nodes with each count of free GPUs, ascending."""

    def assign(self, degrees: np.ndarray, force: bool = False) -> list[tuple[int, ...]] | None:
        """Ranks (ascending) of each ring of `degrees` ranks (module docstring), or None
        where an inter-node ring's rest has no node to go to. A ring gets fewer ranks
        than its degree only where, forced, the degrees add up to more than the GPUs."""
        gpus = self.gpus
        chosen: list[list[int]] = [[] for _ in range(len(degrees))]
        pieces = []
        empty = np.flatnonzero(self.count == gpus).tolist()
        for i in np.argsort(-degrees, kind="stable").tolist():
            full, rest = divmod(int(degrees[i]), gpus)
            nodes, empty = empty[:full], empty[full:]
            for node in nodes:
                chosen[i] += self._pop(node, gpus)
            if int(degrees[i]) > gpus:
                self.crossing[nodes] += 1
            if rest:
                pieces.append((rest, i, full > 0))
        pieces.sort(key=lambda piece: -piece[0])
        for rest, i, crossing in pieces:
            if not crossing:
                node = self._best_fit(rest)
                chosen[i] += self._pop(node, rest) if node is not None else self._scatter(rest)
                continue
            node = self._rest_node(rest, force)
            if node is None and not force:
                return None
            if node is None:  # forced, and no node has room for the rest
                chosen[i] += self._scatter(rest)
                continue
            chosen[i] += self._pop(node, rest)
            self.crossing[node] += 1
        return [tuple(sorted(c)) for c in chosen]

    def _rest_node(self, rest: int, force: bool) -> int | None:
        """The node for an inter-node ring's rest (module docstring)."""
        for limit in (1, MAX_CROSSING):
            node = self._best_fit(rest, limit)
            if node is not None:
                return node
        return self._best_fit(rest) if force else None

    def _best_fit(self, count: int, crossed_below: int | None = None) -> int | None:
        """The node with the fewest free GPUs that still has `count` (of those, the lowest;
        only nodes fewer than `crossed_below` inter-node rings cross)."""
        for nodes in self._by_free[count:]:
            for node in nodes:
                if crossed_below is None or self.crossing[node] < crossed_below:
                    return node
        return None

    def _scatter(self, count: int) -> list[int]:
        """`count` GPUs from the nodes with most free ones (no node has them all)."""
        chosen: list[int] = []
        for node in np.argsort(-self.count, kind="stable").tolist():
            if len(chosen) == count:
                break
            chosen += self._pop(node, min(count - len(chosen), int(self.count[node])))
        return chosen

    def _pop(self, node: int, count: int) -> list[int]:
        taken, self.free[node] = self.free[node][:count], self.free[node][count:]
        before = int(self.count[node])
        bucket = self._by_free[before]
        del bucket[bisect.bisect_left(bucket, node)]
        bisect.insort(self._by_free[before - len(taken)], node)
        self.count[node] -= len(taken)
        return taken
