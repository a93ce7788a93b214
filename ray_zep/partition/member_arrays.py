"""Every ring member of a plan's Ulysses-free queue items, on arrays.

`plan_stats` costs a batch's items; at 1,024-4,096 ranks a batch has thousands of
them, and costing them one by one in Python dominated the data actor's planning
time. This module lays out every member of every item (item by item, in the plan's
execution order; a one-rank item has one member) with the tokens and causal
(query, key) pairs of its ring position, all sequences of the item together: a
position holds the chunks of each sequence its item's layout gives it
(`ray_zep.partition.layout`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ray_zep.partition.carried import sent_on_arrays
from ray_zep.partition.plan import AttentionPlan, QueueItem


@dataclass(frozen=True)
class Members:
    """Shapes: M members over I items.

    Attributes:
        item: the item index of each member (M).
        rank: its rank (M).
        position: its ring position (M).
        tokens: tokens of its ring position (M).
        pairs: causal pairs of its ring position (M).
        starts: each item's first member (I).
        ring: each item's ring size (I).
        rotated: rows its K/V messages carry in one pass of a rotating ring (M;
            `ray_zep.partition.carried`).
    """

    item: np.ndarray
    rank: np.ndarray
    position: np.ndarray
    tokens: np.ndarray
    pairs: np.ndarray
    starts: np.ndarray
    ring: np.ndarray
    rotated: np.ndarray

    def next_member(self) -> np.ndarray:
        """Index of the member each member sends to (the next ring position)."""
        ring = self.ring[self.item]
        return self.starts[self.item] + (self.position + 1) % ring

    def per_item(self, values: np.ndarray, reduce: np.ufunc) -> np.ndarray:
        """`reduce` of `values` (one per member) over each item's members."""
        return reduce.reduceat(values, self.starts)


def plain_members(plan: AttentionPlan, items: list[QueueItem]) -> Members:
    """The members of `items` (all Ulysses-free, at least one)."""
    ring = np.asarray([len(item.ranks) for item in items], dtype=np.int64)
    starts = _starts(ring)
    rank = np.fromiter(itertools.chain.from_iterable(item.ranks for item in items), np.int64)
    member_item = np.repeat(np.arange(len(items)), ring)
    position = np.arange(rank.size) - starts[member_item]
    # every sequence of every item, each cut at its R x C + 1 bounds
    layouts = list(dict.fromkeys(item.layout for item in items))
    item_layout = np.asarray([layouts.index(item.layout) for item in items], dtype=np.int64)
    slots = np.asarray([lay.slots for lay in layouts], dtype=np.int64)[item_layout]
    counts = np.asarray([len(item.seqs) for item in items], dtype=np.int64)
    seq_item = np.repeat(np.arange(len(items)), counts)
    seqs = itertools.chain.from_iterable(item.seqs for item in items)
    bounds = np.fromiter(
        itertools.chain.from_iterable(plan.placement(s).bounds for s in seqs), np.int64
    )
    seq_ring = ring[seq_item]
    first_bound = _starts(slots[seq_item] * seq_ring + 1)
    # one row per (sequence, ring position)
    row_seq = np.repeat(np.arange(seq_item.size), seq_ring)
    row_position = np.arange(row_seq.size) - _starts(seq_ring)[row_seq]
    row_item = seq_item[row_seq]
    member = starts[row_item] + row_position
    tokens = np.zeros(rank.size, dtype=np.int64)
    pairs = np.zeros(rank.size, dtype=np.int64)
    kinds = np.zeros((3, rank.size), dtype=np.int64)  # `Carried`'s three, per member
    for index, layout in enumerate(layouts):
        rows = slice(None) if len(layouts) == 1 else item_layout[row_item] == index
        ring_of, position_of = ring[row_item[rows]], row_position[rows]
        masks = np.stack([layout.carried_mask(np.asarray(a), np.asarray(b))
                          for a, b in ((1, 0), (2, 1), (0, 1))])  # fmt: skip
        for slot in range(layout.slots):
            chunk = first_bound[row_seq[rows]] + layout.chunk_index(ring_of, position_of, slot)
            start, end = bounds[chunk], bounds[chunk + 1]
            np.add.at(tokens, member[rows], end - start)
            np.add.at(pairs, member[rows], (end * (end + 1) - start * (start + 1)) // 2)
            for kind in np.flatnonzero(masks[:, slot]).tolist() if layout.trims else ():
                np.add.at(kinds[kind], member[rows], end - start)
    # whole blocks: every position's but the next one's; else what `Carried.sent` says
    total = np.add.reduceat(tokens, starts)[member_item]
    following = starts[member_item] + (position + 1) % ring[member_item]
    rotated = np.where(ring[member_item] > 1, total - tokens[following], 0)
    trims = np.asarray([lay.trims for lay in layouts])[item_layout][member_item]
    if trims.any():
        trimmed = sent_on_arrays(*kinds, starts, ring, member_item, position)
        rotated = np.where(trims, trimmed, rotated)
    return Members(member_item, rank, position, tokens, pairs, starts, ring, rotated)


def _starts(sizes: np.ndarray) -> np.ndarray:
    """Offsets of consecutive runs of `sizes`."""
    out = np.zeros(sizes.size, dtype=np.int64)
    np.cumsum(sizes[:-1], out=out[1:])
    return out
