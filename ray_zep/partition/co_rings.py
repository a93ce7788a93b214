"""Small rings on ranks that already share a ring: where a level's rings take every rank.

A whole sequence that fits under the level on no rank becomes a small ring inside a
node (`ray_zep.partition.level_fill`), on ranks in no ring yet, so that every ring
starts at once on all its members. Where the rings (and USP groups) of a level hold every
rank of the world, there are none: the sequence then went to the least loaded rank with
token room and could end far above the level. On 13b github at 1,024 GPUs (L = 7,680),
level 1.15 ended at 1.38x the mean rank's that way: 33 sequences of 2.6k-7.7k tokens
fit no rank whole, while the members of the groups held 0.5x the mean rank's work of
room each, in less than 1k free tokens.

Ranks of one node that are members of one and the same ring run it together and end it
together (its members hold equal shares; a USP position's members exchange heads at
every step), so a second ring over some of them, run after it (the engine runs a
rank's rings one after another), waits on no other ring: the ring a hosted ring rides
on (`ray_zep.partition.hosting`) is the same case over a whole node. Such a ring sends
its K/V again in the backward (`Placed.resent`): the first ring's keeping already
counts on the ranks' K/V budget.

Shapes: N nodes, G GPUs per node, D ring sizes (2 .. G).
"""

from __future__ import annotations

import itertools

import numpy as np

from ray_zep.partition.ring_search_kernel import FREE, SEVERAL
from ray_zep.partition.ring_search_kernel import co_member_ring as ring_kernel


class RingLabels:
    """The ring each rank is a member of, as one index per distinct group of ranks of a
    placement's groups (seq -> (ranks, tokens)); `FREE` where none, `SEVERAL` where
    more than one. Sequences sharing one ring (the same ranks) share its label. Groups
    are only ever added to a placement, in order, so `now` reads the new ones alone."""

    def __init__(self, groups: dict, world: int, gpus: int, more: int = 0):
        """`more`: how many groups may be added beyond those `groups` holds now (the
        room `sizes` keeps for them)."""
        self.groups, self.seen, self.gpus = groups, 0, gpus
        self.labels = np.full(world, FREE, dtype=np.int64)
        self.known: dict[tuple[int, ...], int] = {}
        self.sizes = np.zeros(len(groups) + more + 1, dtype=np.int64)
        """Ranks of the group each label was made for (`fill_kernel.deal` reads it)."""

    def now(self) -> np.ndarray:
        """The labels of every rank, the groups added since the last call counted."""
        if self.seen == len(self.groups):
            return self.labels
        new = [ranks for ranks, _ in itertools.islice(self.groups.values(), self.seen, None)
               if ranks not in self.known]  # fmt: skip
        self.seen = len(self.groups)
        for ranks in dict.fromkeys(new):
            self._label(ranks)
        return self.labels

    def added(self, ranks: tuple[int, ...]) -> None:
        """The group just added to the placement's groups, over `ranks` (one call for
        each group added, in order: `now` then reads none again)."""
        self.seen += 1
        if ranks not in self.known:
            self._label(ranks)

    def labelled(self, ranks: tuple[int, ...]) -> None:
        """`added`, where `labels` already says it (`fill_kernel.deal` labelled it): the
        group's label, where it makes one, is the next, as `added` would make it."""
        self.seen += 1
        if ranks not in self.known:
            self.known[ranks] = len(self.known)

    def _label(self, ranks: tuple[int, ...]) -> None:
        self.known[ranks] = len(self.known)
        if self.known[ranks] < self.sizes.size:
            self.sizes[self.known[ranks]] = len(ranks)
        members = np.asarray(ranks, dtype=np.int64)
        self.labels[members] = np.where(self.labels[members] == FREE, self.known[ranks], SEVERAL)


def co_member_ring(
    labels: RingLabels,
    load: np.ndarray,
    tokens: np.ndarray,
    n: int,
    member: np.ndarray,
    level: float,
    capacity: int,
) -> tuple[tuple[int, ...], float] | None:
    """The fewest ranks (2 .. G) of one node, all members of one same ring (`labels`),
    whose work room under `level` and token room take a ring over `n` tokens (`member`:
    its member work at each size); of those, the node and ring of the least loaded rank
    that fits, and its least loaded members. With the ring's member work; None where no
    node has them (`ring_search_kernel.co_member_ring`).

    Args:
        labels: the placement's `RingLabels`.
        load: every rank's modelled work, seconds.
        tokens: every rank's tokens.
        n: the sequence's tokens.
        member: D member works, one per ring size 2 .. G.
        level: the level of work.
        capacity: L.
    """
    ranks, k = ring_kernel(labels.now(), tokens, load, n, member, level, capacity, labels.gpus)
    return None if k < 0 else (tuple(ranks.tolist()), float(member[k]))
