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
- ring (`ring_relay`): the shard is relayed hop by hop around a ring of all
  devices starting at its owner, while every device waits to compute that same
  shard; the gradient travels the same ring, each device adding its own, and
  ends at the owner. (WeiPipe's schedule, where the devices are staggered and
  every ring link carries a shard at once, is not this; only
  `ray_zep.sim.weipipe_schedule` models it.)

Shards and gradients travel in the dtype the model computes in. With
`comm.compression` on, every transfer is a chain of point-to-point messages
(`ray_zep.pipeline.wire`), each plain or zipped: the grouped broadcasts and
reduces run as chains through their members in member order (the volume
`messages` counts), a shard keeps its compressed bytes along a chain, and a
gradient sum is coded again at every hop. The ring's sums add in the same
order either way; a grouped sum adds in chain order instead of the backend's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ray_zep.collectives.adaptive import RingZipper
from ray_zep.distributed import Comm
from ray_zep.errors import CommError
from ray_zep.options import CompressionStream
from ray_zep.parallel.axes import Passing
from ray_zep.parallel.pipeline_layout import WeightLayout
from ray_zep.pipeline.messages import chain_order
from ray_zep.pipeline.wire import Incoming, Wire

FETCH_TAG, GRADIENT_TAG = 0, 1


@dataclass
class Pending:
    """A transfer under way: its buffer, handles and what finishing it still needs."""

    shard: int
    buffer: torch.Tensor
    works: list = field(default_factory=list)
    incoming: Incoming | None = None
    relayed: bool = False


class Transport:
    """Moves shards and gradients under a layout (collective: build on every device).

    Args:
        layout: shard owners and device groups.
        comm: the job's group and topology.
        zipper: `comm.compression`'s per-message choices (None: off).
    """

    def __init__(self, layout: WeightLayout, comm: Comm, zipper: RingZipper | None = None) -> None:
        self.layout = layout
        self.comm = comm
        self.rank = comm.rank
        self.world = comm.group
        self.group_index = layout.group_of(comm.rank)
        self.group = self.world
        self.rail = self.world
        """TawPipe: the devices at this device's local index, one per group."""
        self.chained = zipper is not None
        """Grouped broadcasts and reduces run as chains of messages (compression on)."""
        self.shards = Wire(comm, zipper, CompressionStream.WEIGHT_SHARDS.value, FETCH_TAG)
        self.sums = Wire(comm, zipper, CompressionStream.SHARD_GRADIENTS.value, GRADIENT_TAG)
        if len(layout.groups) > 1 and not self.chained:
            # TawPipe's groups are the nodes, so its rails are the topology's rails
            if comm.groups.node is None or comm.groups.rail is None:
                raise CommError("grouped weight passing needs the Comm's node and rail groups")
            self.group = comm.groups.node.group
            self.rail = comm.groups.rail.group

    @property
    def grouped(self) -> bool:
        return self.layout.passing is Passing.GROUPED

    # --- shards -----------------------------------------------------------------

    def post_fetch(self, shard: int, flat: torch.Tensor) -> Pending:
        """Start bringing `shard` into `flat` (the owner has packed it there)."""
        pending = Pending(shard, flat)
        if self.comm.world_size == 1:
            return pending
        if not self.grouped:
            self._post_along(pending, self._ring(self.layout.owners[shard]), self.shards)
        elif self.chained:
            self._post_along(pending, self._rail_chain(shard), self.shards)
        elif len(self.layout.groups) > 1 and self.rank == self._root(shard):
            owner = self.layout.owners[shard]
            pending.works.append(
                dist.broadcast(pending.buffer, src=owner, group=self.rail, async_op=True)
            )
        return pending

    def finish_fetch(self, pending: Pending) -> torch.Tensor:
        """Wait until the shard is in the buffer; returns it."""
        shard = pending.shard
        what = f"fetching weight shard {shard}"
        if self.comm.world_size == 1:
            return pending.buffer
        if not self.grouped:
            self._relay_along(pending, self._ring(self.layout.owners[shard]), what)
        elif self.chained:
            arrived = self._relay_along(pending, self._rail_chain(shard), what)
            node = self._node_chain(shard)
            self._post_along(pending, node, self.shards, arrived)
            self._relay_along(pending, node, f"{what} in the node")
        else:
            self.comm.wait(pending.works, what)
            pending.works = []
            if len(self._members()) > 1:
                root = self._root(shard)
                work = dist.broadcast(pending.buffer, src=root, group=self.group, async_op=True)
                self.comm.wait([work], f"broadcasting weight shard {shard} in the node")
        return pending.buffer

    def _post_along(
        self, pending: Pending, chain: list[int], wire: Wire, arrived: Incoming | None = None
    ) -> None:
        """A chain broadcast's first leg: its head sends (what `arrived` over the rail,
        as it came), the others post their receive."""
        if self.rank not in chain or len(chain) < 2:
            return
        at = chain.index(self.rank)
        if at == 0 and arrived is not None:
            pending.works += wire.forward(arrived, chain[1])
        elif at == 0:
            pending.works += wire.send(pending.buffer, chain[1])
        else:
            pending.incoming = wire.post_recv(pending.buffer, chain[at - 1])

    def _relay_along(self, pending: Pending, chain: list[int], what: str) -> Incoming | None:
        """A chain broadcast's rest: receive, pass it on, and wait for what was sent;
        returns what arrived (None at the head)."""
        self.comm.wait(pending.works, what)
        pending.works = []
        incoming, pending.incoming = pending.incoming, None
        if incoming is None:
            return None
        incoming.wait(what)
        at = chain.index(self.rank)
        if at + 1 < len(chain):
            self.comm.wait(incoming.wire.forward(incoming, chain[at + 1]), f"relaying: {what}")
        return incoming

    # --- gradients --------------------------------------------------------------

    def post_reduce(self, shard: int, grad: torch.Tensor) -> Pending:
        """Start summing every device's gradient of `shard` towards its owner (the
        node reduce or the ring's first send)."""
        pending = Pending(shard, grad)
        if self.comm.world_size == 1:
            return pending
        owner = self.layout.owners[shard]
        if not self.grouped:
            self._post_sum(pending, self._ring((owner + 1) % self.comm.world_size))
        elif self.chained:
            self._post_sum(pending, self._node_chain(shard)[::-1])
        elif len(self._members()) > 1:
            root = self._root(shard)
            pending.works.append(dist.reduce(grad, dst=root, group=self.group, async_op=True))
        return pending

    def relay_reduce(self, pending: Pending) -> None:
        """The sum's second leg, one shard after `post_reduce`: TawPipe's roots start
        the reduce over the rail; in the ring each device adds its gradient to the
        partial sum that arrived and passes it on."""
        pending.relayed = True
        if self.comm.world_size == 1:
            return
        shard = pending.shard
        what = f"summing the gradient of weight shard {shard}"
        if not self.grouped:
            owner = self.layout.owners[shard]
            self._add_along(pending, self._ring((owner + 1) % self.comm.world_size), what)
            return
        if self.chained:
            self._add_along(pending, self._node_chain(shard)[::-1], f"{what} in the node")
            if self.rank == self._root(shard):
                self._post_sum(pending, self._rail_chain(shard)[::-1])
            return
        self.comm.wait(pending.works, what)
        pending.works = []
        if len(self.layout.groups) > 1 and self.rank == self._root(shard):
            owner = self.layout.owners[shard]
            work = dist.reduce(pending.buffer, dst=owner, group=self.rail, async_op=True)
            pending.works.append(work)

    def finish_reduce(self, pending: Pending) -> torch.Tensor | None:
        """Wait for the sum (after `relay_reduce`); the owner gets it, the others None."""
        shard = pending.shard
        what = f"summing the gradient of weight shard {shard}"
        if self.chained and self.grouped and self.rank == self._root(shard):
            self._add_along(pending, self._rail_chain(shard)[::-1], f"{what} over the rail")
        self.comm.wait(pending.works, what)
        pending.works = []
        return pending.buffer if self.rank == self.layout.owners[shard] else None

    def _post_sum(self, pending: Pending, chain: list[int]) -> None:
        """A chain sum's first leg: its head sends its gradient, the others post the
        receive of the partial sum."""
        if self.rank not in chain or len(chain) < 2:
            return
        at = chain.index(self.rank)
        if at == 0:
            pending.works += self.sums.send(pending.buffer, chain[1])
        else:
            partial = torch.empty_like(pending.buffer)
            pending.incoming = self.sums.post_recv(partial, chain[at - 1])

    def _add_along(self, pending: Pending, chain: list[int], what: str) -> None:
        """A chain sum's next leg: add this device's gradient to the partial sum that
        arrived and pass it on (posted, waited by the next phase)."""
        self.comm.wait(pending.works, what)
        pending.works = []
        incoming, pending.incoming = pending.incoming, None
        if incoming is None:
            return
        pending.buffer = _add(incoming.wait(what), pending.buffer)
        at = chain.index(self.rank)
        if at + 1 < len(chain):
            pending.works += self.sums.send(pending.buffer, chain[at + 1])

    # --- helpers ----------------------------------------------------------------

    def _members(self) -> tuple[int, ...]:
        return self.layout.groups[self.group_index]

    def _root(self, shard: int) -> int:
        return self.layout.root(shard, self.group_index)

    def _ring(self, first: int) -> list[int]:
        """Every device in ring order, starting at `first`."""
        return chain_order(list(range(self.comm.world_size)), first)

    def _rail_chain(self, shard: int) -> list[int]:
        """The groups' roots of `shard`, starting at its owner (TawPipe's rail)."""
        roots = [self.layout.root(shard, g) for g in range(len(self.layout.groups))]
        return chain_order(roots, self.layout.owners[shard])

    def _node_chain(self, shard: int) -> list[int]:
        """This device's group, starting at its root of `shard`."""
        return chain_order(list(self._members()), self._root(shard))


def _add(partial: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """partial + own, added in float32 (in place when the gradients are float32)."""
    if partial.dtype == torch.float32:
        return partial.add_(own)
    return (partial.float() + own.float()).to(partial.dtype)
