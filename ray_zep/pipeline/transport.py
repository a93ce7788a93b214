"""How a shard reaches the devices that borrow it, and its gradient returns.

Each transfer runs in phases so the pipeline can compute while the slow part
runs: `post_*` starts it, `finish_*` completes it, and a gradient sum has a
middle leg, `relay_reduce`, started one shard after the post; every handle is
waited on within the configured timeout.

- grouped (TawPipe): the owner broadcasts the shard across nodes to the
  devices at its own local index (its rail: one root per group, a point to
  point send when there are two groups), then each root broadcasts it inside
  its group; gradients are reduced inside each group to its root, then over
  the rail to the owner.
- ring (WeiPipe-style): the shard is relayed around a ring of all devices
  starting at its owner; the gradient travels the same ring, each device
  adding its own, and ends at the owner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ray_zep.dist import Comm
from ray_zep.errors import CommError
from ray_zep.parallel.axes import Passing
from ray_zep.pipeline.layout import WeightLayout

FETCH_TAG, GRADIENT_TAG = 0, 1


@dataclass
class Pending:
    """A transfer under way: its buffer, handles and what finishing it still needs."""

    shard: int
    buffer: torch.Tensor
    works: list = field(default_factory=list)
    extra: list[torch.Tensor] = field(default_factory=list)
    relayed: bool = False


class Transport:
    """Moves shards and gradients under a layout (collective: build on every device)."""

    def __init__(self, layout: WeightLayout, comm: Comm) -> None:
        self.layout = layout
        self.comm = comm
        self.rank = comm.rank
        self.world = comm.group
        self.group_index = layout.group_of(comm.rank)
        self.group = self.world
        self.rail = self.world
        """TawPipe: the devices at this device's local index, one per group."""
        if len(layout.groups) > 1:
            # TawPipe's groups are the nodes, so its rails are the topology's rails
            if comm.groups.node is None or comm.groups.rail is None:
                raise CommError("grouped weight passing needs the Comm's node and rail groups")
            self.group = comm.groups.node.group
            self.rail = comm.groups.rail.group

    # --- shards -----------------------------------------------------------------

    def post_fetch(self, shard: int, flat: torch.Tensor) -> Pending:
        """Start bringing `shard` into `flat` (the owner has packed it there)."""
        pending = Pending(shard, flat)
        if self.comm.world_size == 1:
            return pending
        if self.layout.passing is Passing.GROUPED:
            self._post_grouped_fetch(pending)
        else:
            self._post_ring_fetch(pending)
        return pending

    def finish_fetch(self, pending: Pending) -> torch.Tensor:
        """Wait until the shard is in the buffer; returns it."""
        self.comm.wait(pending.works, f"fetching weight shard {pending.shard}")
        pending.works = []
        if self.comm.world_size == 1:
            return pending.buffer
        if self.layout.passing is Passing.GROUPED:
            root = self.layout.root(pending.shard, self.group_index)
            if len(self.layout.groups[self.group_index]) > 1:
                work = dist.broadcast(pending.buffer, src=root, group=self.group, async_op=True)
                self.comm.wait([work], f"broadcasting weight shard {pending.shard} in the node")
        else:
            after = self._ring_next(self.rank)
            if (
                self.rank != self.layout.owners[pending.shard]
                and after != self.layout.owners[pending.shard]
            ):
                work = dist.isend(pending.buffer, after, group=self.world, tag=FETCH_TAG)
                self.comm.wait([work], f"relaying weight shard {pending.shard}")
        return pending.buffer

    def _post_grouped_fetch(self, pending: Pending) -> None:
        shard = pending.shard
        if len(self.layout.groups) > 1 and self.rank == self.layout.root(shard, self.group_index):
            owner = self.layout.owners[shard]
            pending.works.append(
                dist.broadcast(pending.buffer, src=owner, group=self.rail, async_op=True)
            )

    def _post_ring_fetch(self, pending: Pending) -> None:
        owner = self.layout.owners[pending.shard]
        if self.rank == owner:
            after = self._ring_next(owner)
            pending.works.append(dist.isend(pending.buffer, after, group=self.world, tag=FETCH_TAG))
        else:
            before = self._ring_next(self.rank, -1)
            pending.works.append(
                dist.irecv(pending.buffer, before, group=self.world, tag=FETCH_TAG)
            )

    # --- gradients --------------------------------------------------------------

    def post_reduce(self, shard: int, grad: torch.Tensor) -> Pending:
        """Start summing every device's gradient of `shard` towards its owner (the
        node reduce or the ring's first send)."""
        pending = Pending(shard, grad)
        if self.comm.world_size == 1:
            return pending
        owner = self.layout.owners[shard]
        if self.layout.passing is Passing.GROUPED:
            root = self.layout.root(shard, self.group_index)
            if len(self._members()) > 1:
                pending.works.append(dist.reduce(grad, dst=root, group=self.group, async_op=True))
        else:
            first = self._ring_next(owner)
            if self.rank == first:
                after = self._ring_next(self.rank)
                pending.works.append(dist.isend(grad, after, group=self.world, tag=GRADIENT_TAG))
            else:
                before = self._ring_next(self.rank, -1)
                partial = torch.empty_like(grad)
                pending.extra.append(partial)
                pending.works.append(
                    dist.irecv(partial, before, group=self.world, tag=GRADIENT_TAG)
                )
        return pending

    def relay_reduce(self, pending: Pending) -> None:
        """The sum's second leg, one shard after `post_reduce`: TawPipe's roots start
        the reduce over the rail; in the ring each device adds its gradient to the
        partial sum that arrived and passes it on."""
        pending.relayed = True
        if self.comm.world_size == 1:
            return
        what = f"summing the gradient of weight shard {pending.shard}"
        self.comm.wait(pending.works, what)
        pending.works = []
        if self.layout.passing is Passing.GROUPED:
            root = self.layout.root(pending.shard, self.group_index)
            if len(self.layout.groups) > 1 and self.rank == root:
                owner = self.layout.owners[pending.shard]
                work = dist.reduce(pending.buffer, dst=owner, group=self.rail, async_op=True)
                pending.works.append(work)
        elif pending.extra:
            # a partial sum arrived from the ring: add ours, pass it on unless we own it
            pending.buffer = pending.extra.pop().add_(pending.buffer)
            if self.rank != self.layout.owners[pending.shard]:
                after = self._ring_next(self.rank)
                pending.works.append(
                    dist.isend(pending.buffer, after, group=self.world, tag=GRADIENT_TAG)
                )

    def finish_reduce(self, pending: Pending) -> torch.Tensor | None:
        """Wait for the sum (after `relay_reduce`); the owner gets it, the others None."""
        self.comm.wait(pending.works, f"summing the gradient of weight shard {pending.shard}")
        pending.works = []
        return pending.buffer if self.rank == self.layout.owners[pending.shard] else None

    # --- helpers ----------------------------------------------------------------

    def _members(self) -> tuple[int, ...]:
        return self.layout.groups[self.group_index]

    def _ring_next(self, rank: int, step: int = 1) -> int:
        return (rank + step) % self.comm.world_size
