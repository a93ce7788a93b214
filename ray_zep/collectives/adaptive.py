"""Collectives that pick the plain or the zipped path per call (`comm.compression`).

One object per process group: it holds the switcher (profiled at creation
when the mode is `auto`, or sharing another group's profile) and counts, per
stream, the bytes handed to its collectives and the bytes they sent into the
rank's `StreamTally`. A stream not listed in `comm.compression_streams`, or a
dtype the codec does not code, always takes the plain path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from ray_zep.collectives import ops
from ray_zep.collectives.format import FORMATS
from ray_zep.collectives.ops import Sizes
from ray_zep.collectives.switcher import Kind, Profile, Switcher, profile_group
from ray_zep.collectives.tally import StreamTally
from ray_zep.config import Compression
from ray_zep.distributed.group import Group
from ray_zep.options import COMPRESSION_STREAMS

log = logging.getLogger(__name__)


class AdaptiveCollectives:
    """Plain-or-zipped collectives of one group.

    Args:
        g: the group and its timeout.
        mode: `comm.compression`.
        refresh_calls: every how many calls a stream measures its ratio again.
        tally: the rank's byte counts per stream (a new one if None).
        streams: the streams that may go zipped (`comm.compression_streams`).
        profile: the switcher's measured costs; None profiles `g` (collective)
            when the mode is `auto`. Groups of one shape may share one.
    """

    def __init__(
        self,
        g: Group,
        mode: Compression,
        refresh_calls: int = 32,
        tally: StreamTally | None = None,
        streams: tuple[str, ...] | list[str] = COMPRESSION_STREAMS,
        profile: Profile | None = None,
    ) -> None:
        self.g = g
        if profile is None and mode is Compression.AUTO:
            profile = profile_group(g)
            if g.rank == 0:
                log.info("compression switcher profile: %s", profile.to_dict())
        self.switcher = Switcher(mode, profile, refresh_calls)
        self.tally = tally if tally is not None else StreamTally()
        self.streams = frozenset(streams)

    def all_reduce_sum_(self, flat: torch.Tensor, stream: str) -> None:
        """Sum a 1-D tensor over the group in place, zipped when that is faster."""

        def zipped() -> Sizes:
            total, sizes = ops.zipped_all_reduce(flat, self.g, what=stream)
            flat.copy_(total)
            return sizes

        plain = partial(dist.all_reduce, flat, group=self.g.group, async_op=True)
        self._either(Kind.ALL_REDUCE, stream, flat, plain, zipped)

    def all_gather_into_(self, out: torch.Tensor, shard: torch.Tensor, stream: str) -> None:
        """`out` = every rank's equal-sized 1-D `shard`, in rank order (a move: same bits)."""

        def zipped() -> Sizes:
            gathered, sizes = ops.zipped_all_gather(shard, self.g, what=stream)
            torch.cat(gathered, out=out)
            return sizes

        plain = partial(ops.all_gather_single, out, shard, group=self.g.group, async_op=True)
        self._either(Kind.ALL_GATHER, stream, shard, plain, zipped)

    def reduce_scatter_into_(self, out: torch.Tensor, full: torch.Tensor, stream: str) -> None:
        """`out` = the sum over ranks of block `rank` of the 1-D `full` (size x out)."""

        def zipped() -> Sizes:
            reduced, sizes = ops.zipped_reduce_scatter(full, self.g, what=stream)
            out.copy_(reduced)
            return sizes

        plain = partial(ops.reduce_scatter_single, out, full, group=self.g.group, async_op=True)
        self._either(Kind.REDUCE_SCATTER, stream, full, plain, zipped)

    def post_all_to_all_rows(
        self,
        x: torch.Tensor,
        send_rows: list[int],
        recv_rows: list[int],
        stream: str,
        what: str,
        agreed_bytes: int,
    ) -> ops.PlainAllToAll | ops.ZippedAllToAll:
        """Start an all-to-all of rows (send_rows[r] to rank r, recv_rows[r] from r);
        `.wait()` on the result gives the received rows. A move: same bits either way.

        Args:
            agreed_bytes: a size every rank of the group passes the same (the mean
                bytes per rank of the exchange): the switcher decides on it, so
                every rank takes the same path and design.
        """
        if not self._zipped(Kind.ALL_TO_ALL, stream, x, agreed_bytes):
            self._count_plain(stream, agreed_bytes)
            return ops.post_plain_all_to_all(x, send_rows, recv_rows, self.g, what)
        design = self.switcher.all_to_all_design(agreed_bytes, stream)
        out = x.new_empty((sum(recv_rows), *x.shape[1:]))
        posted = ops.post_zipped_all_to_all(x, send_rows, recv_rows, self.g, design, what, out)
        self._record(stream, posted.sizes)
        return posted

    def ring_zipper(self) -> RingZipper:
        """Per-message choices for this rank's ring transfers, sharing the profile."""
        return RingZipper(self.switcher, self.g.rank, self.tally, frozenset(self.streams))

    def _either(
        self,
        kind: Kind,
        stream: str,
        tensor: torch.Tensor,
        plain: Callable[[], dist.Work],
        zipped: Callable[[], Sizes],
    ) -> None:
        """Run the zipped or the plain (posted, then waited) form of one collective."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._zipped(kind, stream, tensor, nbytes):
            self._record(stream, zipped())
            return
        self.g.wait([plain()], f"{kind.value.replace('_', '-')} of {stream}")
        if kind is Kind.ALL_REDUCE:  # counted as its zipped form moves it (RS, then AG)
            padded = -(-tensor.numel() // self.g.size) * tensor.element_size()
            nbytes = padded * (self.g.size + 1)
        self._count_plain(stream, nbytes)

    def _zipped(self, kind: Kind, stream: str, tensor: torch.Tensor, nbytes: int) -> bool:
        if stream not in self.streams or tensor.dtype not in FORMATS or tensor.numel() == 0:
            return False
        return self.switcher.use_zipped(kind, stream, nbytes)

    def _record(self, stream: str, sizes: Sizes) -> None:
        """A zipped call's sizes, the same on every rank: counted once, by rank 0."""
        self.switcher.observe(stream, sizes)
        if self.g.rank == 0:
            self.tally.add(stream, sizes.raw_bytes, sizes.wire_bytes, zipped=True)

    def _count_plain(self, stream: str, nbytes: int) -> None:
        """A plain call moves every rank's bytes uncompressed: raw = sent."""
        if self.g.rank == 0:
            total = nbytes * self.g.size
            self.tally.add(stream, total, total, zipped=False)


class RingZipper:
    """Chooses, per point-to-point message, whether it travels zipped: ring K/V (`kv`),
    the Ulysses head exchange, the remapping layer's rows, routed K/V (`choose`: the
    message says its kind itself) and weight passing's shards and gradient sums.

    A link's choices depend only on the stream, the message sizes and the ratios
    of its earlier zipped messages, which both ends know, so sender and receiver
    always agree. Counts this rank's sent bytes (raw and on the wire) per stream.
    """

    def __init__(
        self, switcher: Switcher, rank: int, tally: StreamTally, streams: frozenset[str]
    ) -> None:
        self.switcher, self.rank, self.tally, self.streams = switcher, rank, tally, streams

    def zip_send(self, stream: str, peer: int, tensor: torch.Tensor) -> bool:
        nbytes = tensor.numel() * tensor.element_size()
        zipped = self._decide(stream, self._link(stream, self.rank, peer), tensor, nbytes)
        if not zipped:
            self.tally.add(stream, nbytes, nbytes, zipped=False)
        return zipped

    def choose(self, stream: str, peer: int, tensor: torch.Tensor) -> bool:
        """Whether a message to `peer` goes zipped, where the message itself tells the
        receiver (routed frames): nothing tallied, see `framed_sent`."""
        nbytes = tensor.numel() * tensor.element_size()
        return self._decide(stream, self._link(stream, self.rank, peer), tensor, nbytes)

    def framed_sent(self, stream: str, peer: int, raw: int, wire: int, zipped: bool) -> None:
        """Tally a message `choose` decided, learning the link's ratio when zipped."""
        self.tally.add(stream, raw, wire, zipped)
        if zipped:
            self.switcher.observe(self._link(stream, self.rank, peer), Sizes(raw, wire))

    def zip_recv(self, stream: str, peer: int, buf: torch.Tensor) -> bool:
        nbytes = buf.numel() * buf.element_size()
        return self._decide(stream, self._link(stream, peer, self.rank), buf, nbytes)

    def sent(self, stream: str, peer: int, tensor: torch.Tensor, wire_bytes: int) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.tally.add(stream, nbytes, wire_bytes, zipped=True)
        self.switcher.observe(self._link(stream, self.rank, peer), Sizes(nbytes, wire_bytes))

    def received(self, stream: str, peer: int, out: torch.Tensor, wire_bytes: int) -> None:
        nbytes = out.numel() * out.element_size()
        self.switcher.observe(self._link(stream, peer, self.rank), Sizes(nbytes, wire_bytes))

    def _decide(self, stream: str, link: str, tensor: torch.Tensor, nbytes: int) -> bool:
        if stream not in self.streams or tensor.dtype not in FORMATS or tensor.numel() == 0:
            return False
        return self.switcher.use_zipped(Kind.ALL_TO_ALL, link, nbytes)

    @staticmethod
    def _link(stream: str, src: int, dst: int) -> str:
        return f"{stream} {src}->{dst}"
