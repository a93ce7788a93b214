"""Which device sends a shard (or its gradient) to which: the traffic of a weight-passing step.

Broadcasts and reduces are counted as chains (a ring broadcast: each member
sends the whole shard to the next; a reduce runs the chain backwards), the
volume NCCL's ring algorithm moves; a tree moves the same bytes per member.
"""

from __future__ import annotations

import itertools

from ray_zep.parallel.axes import Passing
from ray_zep.parallel.pipeline_layout import WeightLayout
from ray_zep.topology import Topology
from ray_zep.traffic import Traffic

Message = tuple[int, int]


def chain_order(members: list[int] | tuple[int, ...], first: int) -> list[int]:
    """`members` in member order, rotated to start at `first`."""
    start = members.index(first)
    return [*members[start:], *members[:start]]


def _chain(members: list[int], first: int) -> list[Message]:
    """A chain through `members` starting at `first`, in member order."""
    return list(itertools.pairwise(chain_order(members, first)))


def fetch_messages(layout: WeightLayout, shard: int) -> list[Message]:
    """Messages that bring `shard` from its owner to every device."""
    owner = layout.owners[shard]
    if layout.passing is not Passing.GROUPED:
        return _chain(list(range(len(layout.owners))), owner)
    roots = [layout.root(shard, g) for g in range(len(layout.groups))]
    messages = _chain(roots, owner)
    for group, members in enumerate(layout.groups):
        messages += _chain(list(members), roots[group])
    return messages


def reduce_messages(layout: WeightLayout, shard: int) -> list[Message]:
    """Messages that sum `shard`'s gradient at its owner."""
    if layout.passing is Passing.RING:
        devices = len(layout.owners)
        return _chain(list(range(devices)), (layout.owners[shard] + 1) % devices)
    return [(dst, src) for src, dst in fetch_messages(layout, shard)]


def step_traffic(layout: WeightLayout, shard_bytes: list[int], topology: Topology) -> Traffic:
    """Bytes of one step: every shard but the last fetched twice, every gradient summed once."""
    traffic = Traffic.zero(topology)
    last = layout.shards - 1
    for shard, nbytes in enumerate(shard_bytes):
        fetches = fetch_messages(layout, shard) * (1 if shard == last else 2)
        for src, dst in fetches + reduce_messages(layout, shard):
            traffic.charge(topology, src, dst, nbytes)
    return traffic
