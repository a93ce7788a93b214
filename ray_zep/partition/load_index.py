"""Ranks ordered by modelled load, for best-fit queries under a token bound: the compiled
index (`ray_zep.partition.fill_kernel`) behind a Python object.

The work planner deals whole sequences one by one, each to the fullest rank whose load
leaves room for it among the ranks with token room (`ray_zep.partition.level_fill`); the
fill runs the index's kernels itself (`ray_zep.partition.fill_kernel`). This object
answers the same queries one at a time, for a caller outside a kernel.
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition import fill_kernel


class LoadIndex:
    """Best-fit queries over ranks whose `load` (float64) and `tokens` (int64) arrays the
    caller owns (call `move` after changing a rank's entries; `take` writes them)."""

    def __init__(self, load: np.ndarray, tokens: np.ndarray) -> None:
        self.load, self.tokens = load, tokens
        self.index = fill_kernel.new_index(load.size)

    def set_bound(self, most_tokens: int) -> None:
        """Only ranks holding at most `most_tokens` tokens answer from now on."""
        fill_kernel.set_bound(self.index, most_tokens, self.load, self.tokens)

    def fullest_under(self, room: float) -> int | None:
        """The rank with the most load not above `room` (lowest rank on ties)."""
        return _rank(fill_kernel.fullest_under(self.index, float(room)))

    def least_loaded(self) -> int | None:
        """The rank with the least load (lowest rank on ties)."""
        return _rank(fill_kernel.least_loaded(self.index))

    def take(self, room: float, work: float, tokens: int, then: int | None = None) -> int | None:
        """Best fit in one pass: the fullest rank with load not above `room`, else the
        least loaded, given `work` and `tokens` and filed again; None when no rank answers.
        `then`: the bound the caller sets next (a rank within it is filed at once)."""
        then = -1 if then is None else then
        return _rank(fill_kernel.take(self.index, float(room), float(work), int(tokens), then,
                                      self.load, self.tokens))  # fmt: skip

    def move(self, rank: int) -> None:
        """Files `rank` again after its load or tokens changed."""
        fill_kernel.move(self.index, rank, self.load, self.tokens)


def _rank(rank: int) -> int | None:
    return None if rank < 0 else int(rank)
