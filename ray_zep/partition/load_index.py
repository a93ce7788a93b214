"""Ranks ordered by modelled load, for best-fit queries under a token bound.

The work planner deals whole sequences one by one, each to the fullest rank whose
load leaves room for it among the ranks with token room (`ray_zep.partition.balance`).
Scanning every rank's load per sequence costs O(ranks) array work each time: tens of
thousands of sequences on 4,096 ranks take seconds. This index keeps the ranks with
token room in a list sorted by (load, -rank), so each query is a bisection, and the
ranks without room in a heap by tokens, from which they return when the bound rises
(sequences come longest first, so the bound rarely falls; when it does, the index is
rebuilt). Answers equal the array scans exactly, ties going to the lowest rank.
"""

from __future__ import annotations

import bisect
import heapq
import math

import numpy as np


class LoadIndex:
    """Best-fit queries over ranks whose `load` and `tokens` lists the caller owns (call
    `move` or `update` after changing a rank's entries). Lists, not arrays: the planner
    reads and writes one rank at a time, which Python lists do several times faster."""

    def __init__(self, load: list[float], tokens: list[int]) -> None:
        self.load, self.tokens = load, tokens
        self.bound: int | None = None
        self.ready: list[tuple[float, int]] = []
        self.waiting: list[tuple[int, int]] = []
        self.in_ready = [False] * len(load)
        self.filed = [0.0] * len(load)
        """The load each rank in `ready` was filed under."""

    def set_bound(self, most_tokens: int) -> None:
        """Only ranks holding at most `most_tokens` tokens answer from now on."""
        if most_tokens == self.bound:
            return
        if self.bound is None or most_tokens < self.bound:
            self.bound = most_tokens
            self._rebuild()
            return
        self.bound = most_tokens
        while self.waiting and self.waiting[0][0] <= most_tokens:
            held, rank = heapq.heappop(self.waiting)
            if held == self.tokens[rank] and not self.in_ready[rank]:
                self._insert(rank)

    def fullest_under(self, room: float) -> int | None:
        """The rank with the most load not above `room` (lowest rank on ties)."""
        at = bisect.bisect_right(self.ready, (room, math.inf))
        return -self.ready[at - 1][1] if at else None

    def least_loaded(self) -> int | None:
        """The rank with the least load (lowest rank on ties)."""
        if not self.ready:
            return None
        at = bisect.bisect_right(self.ready, (self.ready[0][0], math.inf))
        return -self.ready[at - 1][1]

    def take(self, room: float, work: float, tokens: int, then: int | None = None) -> int | None:
        """Best fit in one pass: the fullest rank with load not above `room`, else the
        least loaded (lowest rank on ties), given `work` and `tokens` and re-filed; None
        when no rank answers (under the bound `set_bound` set). What `fullest_under`,
        `least_loaded` and `move` do one after another, with one search: the
        whole-sequence fill calls it for every sequence.

        `then`: the bound the caller sets next, before any other query. A rank over
        today's bound but within that one is filed as ready at once, as `set_bound`
        would file it again (the fill's fullest rank mostly lacks room for a second
        sequence as long, and has it for the next, shorter one)."""
        ready = self.ready
        if not ready:
            return None
        at = bisect.bisect_right(ready, (room, math.inf))
        if not at:
            at = bisect.bisect_right(ready, (ready[0][0], math.inf))
        rank = -ready[at - 1][1]
        del ready[at - 1]
        load = self.load[rank] + work
        self.load[rank] = load
        held = self.tokens[rank] + tokens
        self.tokens[rank] = held
        if held <= self.bound or (then is not None and held <= then):
            bisect.insort(ready, (load, -rank))
            self.filed[rank] = load
        else:
            self.in_ready[rank] = False
            heapq.heappush(self.waiting, (held, rank))
        return rank

    def move(self, rank: int) -> None:
        """Re-file `rank` after its load or tokens changed."""
        if self.in_ready[rank]:
            self._remove(rank)
        held = self.tokens[rank]
        if held <= self.bound:
            self._insert(rank)
        else:
            heapq.heappush(self.waiting, (held, rank))

    def update(self, ranks) -> None:
        """`move` for each of `ranks`."""
        for rank in ranks:
            self.move(int(rank))

    def _rebuild(self) -> None:
        load, tokens = np.asarray(self.load), np.asarray(self.tokens)
        fits = tokens <= self.bound
        self.in_ready = fits.tolist()
        ranks = np.flatnonzero(fits)
        self.filed = list(self.load)
        self.ready = sorted(zip(load[ranks].tolist(), (-ranks).tolist(), strict=True))
        out = np.flatnonzero(~fits)
        self.waiting = list(zip(tokens[out].tolist(), out.tolist(), strict=True))
        heapq.heapify(self.waiting)

    def _insert(self, rank: int) -> None:
        load = self.load[rank]
        bisect.insort(self.ready, (load, -rank))
        self.filed[rank] = load
        self.in_ready[rank] = True

    def _remove(self, rank: int) -> None:
        """Takes `rank` out of `ready`, where it stands under the load it was filed with."""
        del self.ready[bisect.bisect_left(self.ready, (self.filed[rank], -rank))]
        self.in_ready[rank] = False
