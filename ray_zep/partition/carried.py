"""What a rotating ring's K/V messages carry, on arrays: the rows of each block its layout
keeps on (`Layout.carried_slots`: the slots that the receiver and the receivers after it
select), for the routing plan, the plan statistics, the byte counts and the simulator.

A message into position x of owner j's block carries, per layout slot, `before`'s key
slots together with `after`'s (where some receivers before the owner remain, j > 0) while
x is after j, and `after`'s alone once it has wrapped (x before j). So three sums of an
owner's slot tokens give every message's rows.

Shapes: R ring positions, C layout slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_zep.partition.layout import Layout


@dataclass(frozen=True)
class Carried:
    """Rows of each owner's block a message carries, by the kind of its receiver.

    Attributes:
        first: receivers after the owner, none before it left (owner 0), R.
        both: receivers after the owner, some before it left, R.
        wrapped: receivers before the owner, R.
    """

    first: np.ndarray
    both: np.ndarray
    wrapped: np.ndarray

    @classmethod
    def of(cls, slot_tokens: np.ndarray, layout: Layout) -> Carried:
        """The rows of `slot_tokens` (R x C: each position's tokens per layout slot, its
        item's sequences together) under `layout`."""
        first, both, wrapped = layout.kind_masks @ np.asarray(slot_tokens, dtype=np.int64).T
        return cls(first, both, wrapped)

    def rows(self, receivers, owners) -> np.ndarray:
        """Rows a message into each of `receivers` carries of the block of each of
        `owners` (arrays of positions, receiver != owner; element-wise)."""
        receivers, owners = np.asarray(receivers), np.asarray(owners)
        after = np.where(owners > 0, self.both[owners], self.first[owners])
        return np.where(receivers > owners, after, self.wrapped[owners])

    def sent(self) -> np.ndarray:
        """Rows each position sends in one pass of the ring (its R - 1 messages: after
        step s it sends position p - s's block on to p + 1), R: position p < R - 1 sends
        owner 0's and owners 1..p's blocks unwrapped and owners p + 2..R - 1's wrapped;
        position R - 1 sends every block but owner 0's wrapped, to position 0."""
        ring = self.first.size
        one = np.zeros(ring, dtype=np.int64)  # every member in item 0, which starts at 0
        return sent_on_arrays(self.first, self.both, self.wrapped, one[:1], np.asarray([ring]),
                              one, np.arange(ring))  # fmt: skip


def sent_on_arrays(
    first: np.ndarray, both: np.ndarray, wrapped: np.ndarray, starts: np.ndarray,
    ring: np.ndarray, item: np.ndarray, position: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """`Carried.sent` of many rings at once: one entry per member (M), members of an item
    consecutive from `starts[item]`, `first`, `both` and `wrapped` each member's
    position's `Carried` rows, `ring` each item's R (I), `item` and `position` each
    member's. 0 for a ring of one position."""
    size = ring[item]
    start = starts[item]
    end = start + size - 1
    total_both = np.cumsum(both)
    total_wrapped = np.cumsum(wrapped)
    owners_both = total_both[start + position] - total_both[start]  # owners 1..p
    later = total_wrapped[end] - total_wrapped[np.minimum(start + position + 1, end)]
    out = first[start] + owners_both + later
    last = position == size - 1
    out[last] = (total_wrapped[end] - total_wrapped[start])[last]  # owners 1..R-1, wrapped
    return np.where(size > 1, out, 0)
