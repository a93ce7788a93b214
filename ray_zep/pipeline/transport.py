"""How a shard reaches the devices that borrow it, and its gradient returns.

Each transport has two phases per transfer so the pipeline can compute while
the slow part runs: `post_*` starts it, `finish_*` completes it; every handle
is waited on within the configured timeout.

- grouped (TawPipe): the owner sends the shard point to point to one root
  device in every other group, then each root broadcasts it inside its group;
  gradients are reduced inside each group to its root, and the roots send
  them to the owner, which adds them up.
- ring (WeiPipe-style): the shard is relayed around a ring of all devices
  starting at its owner; the gradient travels the same ring, each device
  adding its own, and ends at the owner.
- global (FSDP-style): broadcast from the owner to all devices, reduce to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ray_zep.config import Strategy
from ray_zep.mesh import Comm
from ray_zep.pipeline.layout import WeightLayout

FETCH_TAG, GRADIENT_TAG = 0, 1


@dataclass
class Pending:
    """A transfer under way: its buffer, handles and what finishing it still needs."""

    shard: int
    buffer: torch.Tensor
    works: list = field(default_factory=list)
    extra: list[torch.Tensor] = field(default_factory=list)


class Transport:
    """Moves shards and gradients under a layout (collective: build on every device)."""

    def __init__(self, layout: WeightLayout, comm: Comm) -> None:
        self.layout = layout
        self.comm = comm
        self.rank = comm.rank
        self.world = comm.group
        self.group_index = layout.group_of(comm.rank)
        self.group = self.world
        if len(layout.groups) > 1:
            for index, members in enumerate(layout.groups):
                pg = dist.new_group(list(members), timeout=comm.timeout)
                if index == self.group_index:
                    self.group = pg

    # --- shards -----------------------------------------------------------------

    def post_fetch(self, shard: int, flat: torch.Tensor) -> Pending:
        """Start bringing `shard` into `flat` (the owner has packed it there)."""
        strategy = self.layout.strategy
        pending = Pending(shard, flat)
        if self.comm.world_size == 1:
            return pending
        if strategy is Strategy.TAWPIPE:
            self._post_grouped_fetch(pending)
        elif strategy is Strategy.WEIPIPE:
            self._post_ring_fetch(pending)
        else:
            owner = self.layout.owners[shard]
            pending.works.append(dist.broadcast(flat, src=owner, group=self.world, async_op=True))
        return pending

    def finish_fetch(self, pending: Pending) -> torch.Tensor:
        """Wait until the shard is in the buffer; returns it."""
        self.comm.wait(pending.works, f"fetching weight shard {pending.shard}")
        pending.works = []
        if self.comm.world_size == 1:
            return pending.buffer
        if self.layout.strategy is Strategy.TAWPIPE:
            root = self.layout.root(pending.shard, self.group_index)
            if len(self.layout.groups[self.group_index]) > 1:
                work = dist.broadcast(pending.buffer, src=root, group=self.group, async_op=True)
                self.comm.wait([work], f"broadcasting weight shard {pending.shard} in the node")
        elif self.layout.strategy is Strategy.WEIPIPE:
            after = self._ring_next(self.rank)
            if (
                self.rank != self.layout.owners[pending.shard]
                and after != self.layout.owners[pending.shard]
            ):
                work = dist.isend(pending.buffer, after, group=self.world, tag=FETCH_TAG)
                self.comm.wait([work], f"relaying weight shard {pending.shard}")
        return pending.buffer

    def _post_grouped_fetch(self, pending: Pending) -> None:
        shard, flat = pending.shard, pending.buffer
        owner = self.layout.owners[shard]
        if self.rank == owner:
            for group in range(len(self.layout.groups)):
                if group != self.group_index:
                    root = self.layout.root(shard, group)
                    pending.works.append(dist.isend(flat, root, group=self.world, tag=FETCH_TAG))
        elif self.rank == self.layout.root(shard, self.group_index):
            pending.works.append(dist.irecv(flat, owner, group=self.world, tag=FETCH_TAG))

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
        """Start summing every device's gradient of `shard` towards its owner."""
        pending = Pending(shard, grad)
        if self.comm.world_size == 1:
            return pending
        owner = self.layout.owners[shard]
        strategy = self.layout.strategy
        if strategy is Strategy.TAWPIPE:
            root = self.layout.root(shard, self.group_index)
            if len(self._members()) > 1:
                pending.works.append(dist.reduce(grad, dst=root, group=self.group, async_op=True))
        elif strategy is Strategy.WEIPIPE:
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
        else:
            pending.works.append(dist.reduce(grad, dst=owner, group=self.world, async_op=True))
        return pending

    def finish_reduce(self, pending: Pending) -> torch.Tensor | None:
        """Wait for the sum; the owner gets the summed gradient, the others None."""
        what = f"summing the gradient of weight shard {pending.shard}"
        self.comm.wait(pending.works, what)
        owner = self.layout.owners[pending.shard]
        grad = pending.buffer
        if self.comm.world_size > 1 and self.layout.strategy is Strategy.TAWPIPE:
            grad = self._finish_grouped_reduce(pending, owner, what)
        elif self.layout.strategy is Strategy.WEIPIPE and pending.extra:
            # a partial sum arrived from the ring: add ours, pass it on unless we own it
            grad = pending.extra[0].add_(grad)
            if self.rank != owner:
                after = self._ring_next(self.rank)
                work = dist.isend(grad, after, group=self.world, tag=GRADIENT_TAG)
                self.comm.wait([work], what)
        return grad if self.rank == owner else None

    def _finish_grouped_reduce(self, pending: Pending, owner: int, what: str) -> torch.Tensor:
        grad, shard = pending.buffer, pending.shard
        roots = [self.layout.root(shard, g) for g in range(len(self.layout.groups))]
        if self.rank == owner:
            parts = [torch.empty_like(grad) for r in roots if r != owner]
            works = [
                dist.irecv(part, r, group=self.world, tag=GRADIENT_TAG)
                for part, r in zip(parts, [r for r in roots if r != owner], strict=True)
            ]
            self.comm.wait(works, what)
            for part in parts:
                grad.add_(part)
        elif self.rank in roots:
            work = dist.isend(grad, owner, group=self.world, tag=GRADIENT_TAG)
            self.comm.wait([work], what)
        return grad

    # --- helpers ----------------------------------------------------------------

    def _members(self) -> tuple[int, ...]:
        return self.layout.groups[self.group_index]

    def _ring_next(self, rank: int, step: int = 1) -> int:
        return (rank + step) % self.comm.world_size
