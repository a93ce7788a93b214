"""Point-to-point messages of weight passing, each plain or zipped (`comm.compression`).

A zipped message travels in two parts on the same pair of ranks: the static
part, whose size both ends know from the tensor's length, and the dynamic part,
whose size the receiver reads from the static part's header. The sender posts
both at once; the receiver posts the static part, and the dynamic one when it
waits. A link's choice, plain or zipped, is the attention layer's `RingZipper`
rule: it depends only on what both ends of the link know.

A message forwarded unchanged (a shard relayed along a chain) keeps its
compressed bytes: it is coded once, at its owner, and decoded at every hop
that computes with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ray_zep.collectives.adaptive import RingZipper
from ray_zep.collectives.codec import blamed_on, compress, decode_exactly, read_header
from ray_zep.collectives.format import static_bytes
from ray_zep.distributed import Comm

DYNAMIC_TAG_OFFSET = 2
"""A zipped message's dynamic part travels under its stream's tag plus this."""


@dataclass
class Incoming:
    """A message being received into `buffer` (see `Wire.post_recv`)."""

    wire: Wire
    peer: int
    buffer: torch.Tensor
    works: list
    static: torch.Tensor | None = None
    dynamic: torch.Tensor | None = None
    done: bool = False

    @property
    def zipped(self) -> bool:
        return self.static is not None

    def wait(self, what: str) -> torch.Tensor:
        """The received tensor (in `buffer`), decoded; CommError/CodecError on failure."""
        if self.done:
            return self.buffer
        wire = self.wire
        wire.comm.wait(self.works, what)
        self.works = []
        if self.static is not None:
            with blamed_on(wire.source(self.peer, what)):
                header = read_header(self.static)
                self.dynamic = self.static.new_empty(header.dynamic_bytes)
                if header.dynamic_bytes:
                    work = dist.irecv(self.dynamic, self.peer, wire.comm.group, wire.dynamic_tag)
                    wire.comm.wait([work], what)
                decoded = decode_exactly(self.static, self.dynamic, self.buffer.numel(), header)
            self.buffer.view(-1).copy_(decoded)
            nbytes = self.static.numel() + self.dynamic.numel()
            wire.zipper.received(wire.stream, self.peer, self.buffer, nbytes)
        self.done = True
        return self.buffer


@dataclass
class Wire:
    """One stream's messages over the job's group (global ranks).

    Args:
        comm: the job's group and timeout.
        zipper: per-message choices (None: every message plain).
        stream: the `comm.compression_streams` name.
        tag: the stream's message tag (its dynamic parts use tag + 2).
    """

    comm: Comm
    zipper: RingZipper | None
    stream: str
    tag: int

    @property
    def dynamic_tag(self) -> int:
        return self.tag + DYNAMIC_TAG_OFFSET

    def send(self, tensor: torch.Tensor, peer: int) -> list:
        """Post `tensor` to `peer`; the handles to wait on."""
        tensor = tensor.contiguous()
        z = self.zipper
        if z is None or not z.zip_send(self.stream, peer, tensor):
            return [dist.isend(tensor, peer, self.comm.group, self.tag)]
        zipped = compress(tensor)
        z.sent(self.stream, peer, tensor, zipped.nbytes)
        return self._send_parts(zipped.static, zipped.dynamic, peer)

    def forward(self, incoming: Incoming, peer: int) -> list:
        """Post what arrived to `peer`, its compressed bytes as they came when both
        links are zipped (after `incoming.wait`)."""
        z, tensor = self.zipper, incoming.buffer
        if not incoming.zipped or z is None:
            return self.send(tensor, peer)
        if not z.zip_send(self.stream, peer, tensor):
            return [dist.isend(tensor, peer, self.comm.group, self.tag)]
        nbytes = incoming.static.numel() + incoming.dynamic.numel()
        z.sent(self.stream, peer, tensor, nbytes)
        return self._send_parts(incoming.static, incoming.dynamic, peer)

    def post_recv(self, buffer: torch.Tensor, peer: int) -> Incoming:
        """Start receiving a message of `buffer`'s shape and dtype from `peer`."""
        z = self.zipper
        if z is None or not z.zip_recv(self.stream, peer, buffer):
            work = dist.irecv(buffer, peer, self.comm.group, self.tag)
            return Incoming(self, peer, buffer, [work])
        static = buffer.new_empty(static_bytes(buffer.numel(), buffer.dtype), dtype=torch.uint8)
        work = dist.irecv(static, peer, self.comm.group, self.tag)
        return Incoming(self, peer, buffer, [work], static=static)

    def source(self, peer: int, what: str) -> str:
        """Who a zipped message comes from, for its errors."""
        return f"{self.stream} ({what}): the compressed message from rank {peer}"

    def _send_parts(self, static: torch.Tensor, dynamic: torch.Tensor, peer: int) -> list:
        works = [dist.isend(static, peer, self.comm.group, self.tag)]
        if dynamic.numel():
            works.append(dist.isend(dynamic, peer, self.comm.group, self.dynamic_tag))
        return works
