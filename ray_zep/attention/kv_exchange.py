"""Communication of the attention engine: point-to-point exchanges and KV collectives.

Every call is asynchronous where the backend allows it and waited on with the
Comm's timeout; a timeout or a lost peer becomes a CommError naming the peer and
`comm.timeout_s`. Ranks are global ranks of `links.group`. Every call is tallied
in the schedule's `ops` counter, so tests can check that what ran is what the
plan implies.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ray_zep.attention.links import Links
from ray_zep.collectives.codec import blamed_on, compress, decode_exactly, read_header
from ray_zep.collectives.format import static_bytes
from ray_zep.distributed.group import all_gather_single, reduce_scatter_single


class Pending:
    """Handles of posted operations; `wait` completes them all or raises CommError."""

    def __init__(self, works: list, links: Links, what: str) -> None:
        self._works, self._comm, self._what = works, links, what

    def wait(self) -> None:
        self._comm.wait(self._works, self._what)
        self._works = []
        self._held = None

    def hold(self, tensor: torch.Tensor) -> Pending:
        """Keep `tensor` (a message made for this exchange) alive until `wait`."""
        self._held = tensor
        return self

    def extend(self, works: list) -> Pending:
        """These handles plus `works` (routed hops of the same exchange)."""
        self._works.extend(works)
        return self


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    links: Links,
    ops: Counter,
    what: str,
    zip_stream: str | None = None,
) -> Pending:
    """Post sends of (tensor, peer) and receives into (buffer, peer) together.

    With `zip_stream` (a `comm.compression_streams` name) and the zipper of
    `links` (`comm.compression`), each message the zipper picks travels
    compressed (see `ZippedPending`).
    """
    if not sends and not recvs:
        return Pending([], links, what)
    zipper = links.ring_zip if zip_stream is not None else None
    if zipper is not None:
        return _zipped_exchange(sends, recvs, links, ops, what, zipper, zip_stream)
    return Pending(
        _post([(t.contiguous(), peer) for t, peer in sends], recvs, links, ops), links, what
    )


def _post(sends, recvs, links: Links, ops: Counter) -> list:
    """Post sends of (tensor, peer) and receives into (buffer, peer) as one batch."""
    p2p = [dist.P2POp(dist.isend, t, peer, links.group) for t, peer in sends]
    p2p += [dist.P2POp(dist.irecv, buf, peer, links.group) for buf, peer in recvs]
    ops["p2p"] += len(p2p)
    return list(dist.batch_isend_irecv(p2p)) if p2p else []


class ZippedPending(Pending):
    """A point-to-point exchange whose zipped messages travel in two parts.

    The static parts (sizes known to both ends from the tensor shapes) are
    posted with the plain messages and overlap computation; at `wait` the
    receivers read the escape counts from the static headers, and the dynamic
    parts follow. Both ends post in the same program order, so the parts of
    concurrent exchanges between the same two ranks pair up.
    """

    def __init__(self, works, links, what, ops, zipped, zipper, stream) -> None:
        super().__init__(works, links, what)
        self._ops, (self._sends, self._recvs) = ops, zipped
        self._zipper, self._stream = zipper, stream

    def wait(self) -> None:
        super().wait()
        headers = []
        for static, _, peer in self._recvs:
            with blamed_on(self._source(peer)):
                headers.append(read_header(static))
        dynamic_in = [
            static.new_empty(h.dynamic_bytes)
            for h, (static, _, _) in zip(headers, self._recvs, strict=True)
        ]
        sends = [(z.dynamic, peer) for z, peer in self._sends if z.dynamic.numel()]
        recvs = [
            (buf, peer)
            for buf, (_, _, peer) in zip(dynamic_in, self._recvs, strict=True)
            if buf.numel()
        ]
        self._comm.wait(_post(sends, recvs, self._comm, self._ops), self._what)
        for header, dynamic, (static, out, peer) in zip(
            headers, dynamic_in, self._recvs, strict=True
        ):
            with blamed_on(self._source(peer)):
                out.view(-1).copy_(decode_exactly(static, dynamic, out.numel(), header))
            self._zipper.received(self._stream, peer, out, static.numel() + dynamic.numel())
        self._sends, self._recvs = [], []

    def _source(self, peer: int) -> str:
        """Who a zipped message comes from, for its errors."""
        return f"{self._stream} ({self._what}): the compressed message from rank {peer}"


def _zipped_exchange(sends, recvs, links, ops, what, zipper, stream) -> Pending:
    plain_sends, plain_recvs, zipped_sends, zipped_recvs = [], [], [], []
    for tensor, peer in sends:
        if zipper.zip_send(stream, peer, tensor):
            zipped = compress(tensor)
            zipper.sent(stream, peer, tensor, zipped.nbytes)
            zipped_sends.append((zipped, peer))
            plain_sends.append((zipped.static, peer))
        else:
            plain_sends.append((tensor.contiguous(), peer))
    for buf, peer in recvs:
        if zipper.zip_recv(stream, peer, buf):
            static = buf.new_empty(static_bytes(buf.numel(), buf.dtype), dtype=torch.uint8)
            zipped_recvs.append((static, buf, peer))
            plain_recvs.append((static, peer))
        else:
            plain_recvs.append((buf, peer))
    works = _post(plain_sends, plain_recvs, links, ops)
    zipped = (zipped_sends, zipped_recvs)
    return ZippedPending(works, links, what, ops, zipped, zipper, stream)


def all_gather_rows(local: torch.Tensor, rows: int, links: Links, ops: Counter) -> torch.Tensor:
    """Every rank's `local` (rows x ...), padded to `rows`, stacked by rank: (world, rows, ...)."""
    padded = local.new_zeros((rows, *local.shape[1:]))
    padded[: local.shape[0]] = local
    out = local.new_empty((links.world_size * rows, *local.shape[1:]))
    ops["all_gather"] += 1
    work = all_gather_single(out, padded, group=links.group, async_op=True)
    Pending([work], links, "all-gather of K/V").wait()
    return out.view(links.world_size, rows, *local.shape[1:])


def reduce_scatter_rows(stacked: torch.Tensor, links: Links, ops: Counter) -> torch.Tensor:
    """Sum (world, rows, ...) over ranks and keep this rank's slice (rows, ...)."""
    out = stacked.new_empty(stacked.shape[1:])
    ops["reduce_scatter"] += 1
    flat = stacked.reshape(-1, *stacked.shape[2:]).contiguous()
    work = reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=links.group, async_op=True)
    Pending([work], links, "reduce-scatter of dK/dV").wait()
    return out
