"""Which levels `ray_zep.partition.balance` places a batch at, and the placement it keeps.

Levels rise from the mean work until the rings fit the world, and `PAST_FIRST` more are
placed below the busiest rank so far; then the gap under the lowest feasible level is
halved (`BISECTIONS`), stopping at a level abandoned at the busiest rank so far
(`BISECT_BELOW_LOST`). Where the lowest feasible level overflowed (its whole sequences
passed it) and a higher one won, the gap between the two is halved instead
(`bisect_above_overflow`), and so is the gap between a level the halving stopped at and
the best one (`bisect_above_lost`): a level between them may hold its whole sequences and
end lower than either. The placement
whose busiest rank is lowest wins, the first placed on ties. Each level is placed with
the busiest rank of the placements before it as a bound: a placement that reaches it
cannot win and is abandoned (`Placed.pruned`).

**An early bound.** The lowest feasible levels can be the slowest to place: where their
whole sequences overflow the level, nothing placed before them abandons them (on 4,096
GPUs of the chat mix the first feasible level passes its level by 40-60% and ends
1.1-1.3x busier than the level kept, at the cost of a kept level's placement). So the
first level whose rings fit is placed only up to `OVERFLOW` over its level; where it
passes that, the level `GUESS_ABOVE` higher is placed with the same bound, and where that
one ends under it, its busiest rank (the early bound) bounds every level placed before
the scan reaches it. The scan's outcome stays what it is without the early bound,
exactly, because every answer it reads is exact or decided without the missing number:

- a level that ends under a lower bound ends the same under its own, higher one (its
  fill is the same up to the bound);
- one abandoned at a lower bound alone is feasible (its fill cannot run out of tokens:
  `Placed.fill_fits`; else it is placed again at its own bound) with a busiest rank at
  least that bound (its floor). The winner, the overflow test and the stopping rule
  need no more while every floor is above the lowest busiest rank known; where one is
  not, the abandoned levels are placed again at their own bounds, in order (`_settle`);
- the guessed level, when the scan reaches it, is what its placement says: placed where
  the scan's own bound is above its busiest rank, abandoned where it is not (or where
  the guess was abandoned at a bound the scan's is at or under), else placed again.

The trace records an abandoned level as pruned with its floor (`LevelTry.busiest`), and
its own outcome where it was placed again. Where the first feasible level ends under
`OVERFLOW` nothing is guessed and the scan is the plain one; where the guess does not
end under the bound, the first level is placed again at its own. Either way the
placements are those of the plain scan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ray_zep.errors import PlacementError
from ray_zep.partition.level_fill import Placed
from ray_zep.partition.level_trace import LevelOutcome, LevelTry

GUESS_ABOVE = 3
"""The level guessed, this many levels above the first whose rings fit. Over eight chat
batches each of 1,024 and 4,096 GPUs, 7b and 13b (Python calls per `plan_step`, against
the plain scan): 3 saved 14% of the calls, 4 10%, 2 4%, and 1 none. Since groups of
one-node positions whose forward waits on their hops give way to wider ones
(`ray_zep.partition.usp_grid`), fewer first levels overflow: on those batches the early
bound dealt 9.7% fewer whole sequences at 1,024 GPUs and 3.9% fewer at 4,096. Since whole
sequences that fit no rank ride as second rings on members of one group
(`ray_zep.partition.co_rings`), no first level of those batches passes `OVERFLOW` (at
L = 5,120): the early bound deals none fewer there, and stays for batches whose first
level still does."""
OVERFLOW = 0.4
"""How far over its level the first level whose rings fit is placed before a higher one
is guessed. On `bench scale`'s chat batches the first feasible level passes its level by
up to 62%, and still wins on some at 40-45%; 0.3 saved 7% of the calls where 0.4 saved
14% (`GUESS_ABOVE`'s batches)."""

Place = Callable[[float, float, bool, "list[LevelTry] | None"], "Placed | None"]
"""(level factor, prune_above, force, failed) -> that level's placement (pruned once a
rank reaches `prune_above`), None where its rings do not fit (why appended to `failed`
when given); raises PlacementError where its whole sequences find too few free tokens."""


@dataclass
class _Tried:
    factor: float
    placed: Placed | None
    floor: float | None = None
    """Abandoned at this bound, lower than its own: feasible (its fill cannot run out of
    tokens), its busiest rank at least this, by how much not known (`placed` is the
    abandoned placement); None where `placed` is as the scan has it."""
    traced: int | None = None
    """Its entry in the trace."""
    busiest: float = math.inf
    """Its placement's busiest rank (inf where abandoned or not placed)."""

    @classmethod
    def of(cls, factor: float, placed: Placed | None, floor: float | None = None) -> _Tried:
        busiest = math.inf if placed is None else placed.busiest
        return cls(factor, placed, floor, busiest=busiest)


@dataclass(frozen=True)
class ScanRules:
    levels: tuple[float, ...]
    past_first: int
    bisections: int
    bisect_below_overflow: bool
    bisect_above_overflow: bool
    bisect_below_lost: bool = True
    """Go on halving below a level abandoned at the busiest rank so far."""
    bisect_above_lost: int = 0
    """Where the halving stopped at a level abandoned at the busiest rank so far, halve the
    gap between it and the best level this many times (as for `bisect_above_overflow`)."""


class LevelScan:
    """The scan over one batch's levels (module docstring). `place` places one level;
    `mean` is the mean rank's work; `trace`, where given, gets each level tried."""

    def __init__(
        self, place: Place, mean: float, rules: ScanRules, trace: list[LevelTry] | None
    ) -> None:
        self.place, self.mean, self.rules, self.trace = place, mean, rules, trace
        self.tried: list[_Tried] = []
        self.early = math.inf
        """The early bound: the guessed level's busiest rank (inf: none)."""
        self.guess: tuple[float, Placed, float] | None = None
        """The guessed level, its placement and the bound it was placed with."""

    def best(self) -> Placed | None:
        """The placement kept, None where no level's rings fit the world."""
        self._scan()
        self._settle()
        tried = [(t.factor, t.placed) for t in self.tried]
        feasible = [(f, p) for f, p in tried if p is not None]
        if not feasible:
            return None
        rules = self.rules
        low = max((f for f, p in tried if p is None), default=None)
        high, first = min(feasible, key=lambda fp: fp[0])
        overflowed = low is not None and low < high and first.busiest > self.lowest()
        if overflowed and not rules.bisect_below_overflow:
            low = None  # the lowest feasible level overflowed, and a higher one won
        lost = False
        for _ in range(rules.bisections if low is not None else 0):
            middle = (low + high) / 2
            if self.at(middle) is None:
                low = middle
                continue
            high = middle
            if not rules.bisect_below_lost and self._lost():
                lost = True
                break
        if overflowed and rules.bisect_above_overflow:
            self._bisect_above(high, rules.bisections)
        elif lost and rules.bisect_above_lost:
            self._bisect_above(high, rules.bisect_above_lost)
        self._settle()
        return min((t for t in self.tried if t.placed is not None), key=lambda t: t.busiest).placed

    def _bisect_above(self, overflowed: float, halvings: int) -> None:
        """Halves the gap between the level `overflowed` and the level of the best
        placement so far `halvings` times: down where the middle one ends lower than every
        placement before it, else up."""
        exact = [t for t in self.tried if t.placed is not None and t.floor is None]
        low, high = overflowed, min(exact, key=lambda t: t.busiest).factor
        if high <= low:
            return
        for _ in range(halvings):
            middle, best = (low + high) / 2, self.lowest()
            self.at(middle)
            if self.lowest() < best:
                high = middle
            else:
                low = middle

    def forced(self) -> Placed:
        """The highest level placed with rings shrunk to fit (no level's rings fit)."""
        placed = self.at(self.rules.levels[-1], force=True)
        if placed is None:
            raise PlacementError("zeppelin (zone_policy=work): the rings do not fit the ranks")
        return placed

    def mark_kept(self, placed: Placed) -> None:
        if self.trace is not None:
            at = next(t.traced for t in self.tried if t.placed is placed)
            self.trace[at] = self.trace[at]._replace(outcome=LevelOutcome.KEPT)

    def _lost(self) -> bool:
        """Whether the level placed last cannot win: abandoned at the busiest rank of a
        placement before it, or at an early bound at or above that; one abandoned under
        it is placed again at its own (with the levels abandoned before it), as the scan
        without the early bound places it."""
        last = self.tried[-1]
        if last.placed is None or not last.placed.pruned:
            return False
        if last.floor is not None and last.floor < self.lowest():
            self._settle(needed=True)
            return last.placed.pruned
        return True

    def lowest(self) -> float:
        """The busiest rank of the best placement known exactly so far."""
        return min((t.busiest for t in self.tried if t.floor is None), default=math.inf)

    def _scan(self) -> None:
        """Each level's placement, up to the first feasible level and `past_first` more
        below the best busiest rank so far (a level at or above it would have to end under
        its own level to win)."""
        left = None
        for factor in self.rules.levels:
            if left is not None and self._not_below_best(factor):
                break
            placed = self.at(factor)
            if left is None and placed is not None:
                left = self.rules.past_first
            elif left is not None:
                left -= 1
            if left == 0:
                break

    def _not_below_best(self, factor: float) -> bool:
        """`factor` >= the best busiest rank so far over the mean: known, or above
        `factor` for certain, unless some abandoned level's floor is at or under the best
        known (then the abandoned levels are placed again)."""
        if self._open():
            if factor < min(self.lowest(), *self._floors()) / self.mean:
                return False
            self._settle()
        return factor >= self.lowest() / self.mean

    def at(self, factor: float, force: bool = False) -> Placed | None:
        """The placement at `factor` x the mean, as the scan without the early bound has
        it (or abandoned above a bound lower than its own), recorded in order."""
        if self.guess is not None and factor == self.guess[0] and not force:
            guessed = self._guessed_level()
            if guessed is not None:
                return self._record(factor, guessed, [])
        if force:
            return self._place(factor, True, self.lowest())
        if not any(t.placed is not None for t in self.tried):  # no level placed yet
            return self._first(factor)
        return self._place(factor, False, min(self.lowest(), math.nextafter(self.early, math.inf)))

    def _first(self, factor: float) -> Placed | None:
        """The first level whose rings fit: placed up to `OVERFLOW` over its level; where
        it passes that and the guessed level ends under that, it cannot win, and the
        guess's busiest rank is the early bound. Else it is placed as the scan places it."""
        overflow = self.mean * factor * (1 + OVERFLOW)
        placed = self._place(factor, False, overflow, keep_above=False)
        if placed is None or not placed.pruned:
            return placed
        if self._place_guess(factor, overflow):
            self._record_above(factor, placed, overflow)
            return placed
        return self._place(factor, False, self.lowest())

    def _place_guess(self, factor: float, bound: float) -> bool:
        """Places the level `GUESS_ABOVE` above `factor` with `bound`: whether it ended
        under it (its busiest rank is then the early bound)."""
        levels = self.rules.levels
        at = levels.index(factor) + GUESS_ABOVE if factor in levels else len(levels)
        if at >= len(levels):
            return False
        try:
            placed = self.place(levels[at], bound, False, None)
        except PlacementError:
            return False
        if placed is None:
            return False
        self.guess = (levels[at], placed, bound)
        if placed.pruned:
            return False
        self.early = placed.busiest
        return True

    def _guessed_level(self) -> Placed | None:
        """The guessed level as the scan places it, where the guess says: abandoned where
        a placement before it is as good (at or under the guess's busiest rank, or the
        bound the guess was abandoned at); None where the guess does not say."""
        _, placed, bound = self.guess
        self.guess = None
        abandoned = Placed(placed.load[:0], placed.tokens[:0], placed.in_ring[:0], pruned=True)
        if placed.pruned:  # its busiest rank reached `bound`, before any spill failed
            return abandoned if self.lowest() <= bound else None
        if self.lowest() > self.early and any(f <= self.early for f in self._floors()):
            self._settle(needed=True)  # an abandoned level might have set its bound
        return abandoned if self.lowest() <= self.early else placed

    def _place(
        self, factor: float, force: bool, bound: float, keep_above: bool = True
    ) -> Placed | None:
        """The level placed with `bound` (at most its own, the lowest busiest rank so far):
        recorded as the scan has it; abandoned under its own bound, recorded as above the
        bound (`keep_above`) where its fill cannot run out of tokens, else placed again at
        its own bound. Where `keep_above` is false such a placement is returned unrecorded."""
        own = self.lowest()
        failed: list[LevelTry] = []
        try:
            placed = self.place(factor, bound, force, failed)
        except PlacementError:
            if force:
                raise
            failed.append(LevelTry(factor, LevelOutcome.TOKENS))
            return self._record(factor, None, failed)
        if placed is None or not placed.pruned or bound >= own:
            return self._record(factor, placed, failed)
        if not placed.fill_fits:  # abandoned, or out of tokens: only its own bound says
            self._settle()
            return self._place(factor, force, self.lowest())
        if keep_above:
            self._record_above(factor, placed, bound)
        return placed

    def _record(
        self, factor: float, placed: Placed | None, failed: list[LevelTry]
    ) -> Placed | None:
        self.tried.append(_Tried.of(factor, placed))
        if self.trace is not None:
            self._trace(len(self.tried) - 1, _tried(factor, placed, self.mean, failed))
        return placed

    def _record_above(self, factor: float, placed: Placed, floor: float) -> None:
        """A level abandoned at `floor`, lower than its own bound: in the trace, pruned
        with a rank at `floor` (`LevelTry.busiest`: at least that)."""
        self.tried.append(_Tried(factor, placed, floor=floor))  # busiest: not known
        if self.trace is not None:
            busiest = floor / self.mean if self.mean > 0 else 1.0
            self._trace(len(self.tried) - 1, LevelTry(factor, LevelOutcome.PRUNED, busiest))

    def _trace(self, at: int, tried: LevelTry) -> None:
        """The trace's entry for `self.tried[at]`, appended or replaced."""
        entry = self.tried[at]
        if entry.traced is None:
            entry.traced = len(self.trace)
            self.trace.append(tried)
        else:
            self.trace[entry.traced] = tried

    def _floors(self) -> list[float]:
        return [t.floor for t in self.tried if t.floor is not None]

    def _open(self) -> bool:
        """Some abandoned level's busiest rank may be the lowest: its bound is at or under
        the lowest busiest rank known."""
        lowest = self.lowest()
        return any(f <= lowest for f in self._floors())

    def _settle(self, needed: bool | None = None) -> None:
        """Places the levels abandoned under their own bounds again at those, in order,
        where their busiest ranks may matter (`needed`; by default, `_open`)."""
        if not (self._open() if needed is None else needed):
            return
        done: list[_Tried] = []
        for at, t in enumerate(self.tried):
            if t.floor is not None:
                own = min((d.busiest for d in done), default=math.inf)
                placed = self.place(t.factor, own, False, None)
                t.placed, t.floor, t.busiest = placed, None, placed.busiest
                if self.trace is not None:
                    self._trace(at, _tried(t.factor, t.placed, self.mean, []))
            done.append(t)


def _tried(factor: float, placed: Placed | None, mean: float, failed: list[LevelTry]) -> LevelTry:
    """What the level `factor` x `mean` gave, for the trace (`failed`: why it returned
    None; every way it does records one)."""
    if placed is None:
        return failed[-1]._replace(factor=factor)
    if placed.pruned:
        return LevelTry(factor, LevelOutcome.PRUNED)
    level = factor * mean
    fill = placed.ring_work / level if level > 0 else float("nan")
    return LevelTry(factor, LevelOutcome.PLACED, placed.busiest / mean if mean > 0 else 1.0,
                    ring_ranks=placed.ring_ranks, ring_fill=fill)  # fmt: skip
