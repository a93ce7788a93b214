"""Ranks ordered by modelled load, for best-fit queries under a token bound: the compiled
index (`ray_zep.partition.index_kernel`), its arrays (`new_index`), and a Python object
over them.

The work planner deals whole sequences one by one, each to the fullest rank whose load
leaves room for it among the ranks with token room (`ray_zep.partition.level_fill`); the
fill's dealing runs the index's kernels itself (`ray_zep.partition.fill_kernel`). This object
answers the same queries one at a time, for a caller outside a kernel.
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition import index_kernel


def new_index(world: int, spare: int = 256) -> tuple:
    """An empty index of `world` ranks (`index_kernel`): the filed ranks'
    loads and negated ranks in blocks, the counters, each rank's whether filed and filed
    load, the heap's tokens and ranks (room for `spare` entries more than there are
    ranks: a full heap drops its stale entries, and a rank holds one live entry at
    most), each block's size, the blocks in order, and the free blocks."""
    heap, blocks = world + spare, world + 1  # a block holds one filed rank at least
    counters = np.zeros(6, dtype=np.int64)
    counters[-1] = blocks  # every block free
    return (np.zeros((blocks, index_kernel.BLOCK)),
            np.zeros((blocks, index_kernel.BLOCK), dtype=np.int64), counters,
            np.zeros(world, dtype=np.bool_), np.zeros(world), np.zeros(heap, dtype=np.int64),
            np.zeros(heap, dtype=np.int64), np.zeros(blocks, dtype=np.int64),
            np.zeros(blocks, dtype=np.int64),
            np.arange(blocks, dtype=np.int64)[::-1].copy())  # fmt: skip


class LoadIndex:
    """Best-fit queries over ranks whose `load` (float64) and `tokens` (int64) arrays the
    caller owns (call `move` after changing a rank's entries; `take` writes them)."""

    def __init__(self, load: np.ndarray, tokens: np.ndarray) -> None:
        self.load, self.tokens = load, tokens
        self.index = new_index(load.size)

    def set_bound(self, most_tokens: int) -> None:
        """Only ranks holding at most `most_tokens` tokens answer from now on."""
        index_kernel.set_bound(self.index, most_tokens, self.load, self.tokens)

    def fullest_under(self, room: float) -> int | None:
        """The rank with the most load not above `room` (lowest rank on ties)."""
        return _rank(index_kernel.fullest_under(self.index, float(room)))

    def least_loaded(self) -> int | None:
        """The rank with the least load (lowest rank on ties)."""
        return _rank(index_kernel.least_loaded(self.index))

    def take(self, room: float, work: float, tokens: int, then: int | None = None) -> int | None:
        """Best fit in one pass: the fullest rank with load not above `room`, else the
        least loaded, given `work` and `tokens` and filed again; None when no rank answers.
        `then`: the bound the caller sets next (a rank within it is filed at once)."""
        then = -1 if then is None else then
        return _rank(index_kernel.take(self.index, float(room), float(work), int(tokens), then,
                                      self.load, self.tokens))  # fmt: skip

    def move(self, rank: int) -> None:
        """Files `rank` again after its load or tokens changed."""
        index_kernel.move(self.index, rank, self.load, self.tokens)


def _rank(rank: int) -> int | None:
    return None if rank < 0 else int(rank)
