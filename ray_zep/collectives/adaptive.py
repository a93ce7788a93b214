"""Collectives that pick the plain or the zipped path per call (`comm.compression`).

One object per process group: it holds the switcher (profiled at creation
when the mode is `auto`) and the tally of bytes handed to collectives versus
bytes sent, which the trainer reports as the compression ratio and the bytes
saved.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ray_zep.collectives import comms
from ray_zep.collectives.comms import Sizes
from ray_zep.collectives.format import FORMATS
from ray_zep.collectives.switcher import Kind, Switcher, profile_group
from ray_zep.config import Compression
from ray_zep.dist.group import Group

log = logging.getLogger(__name__)


class AdaptiveCollectives:
    """Plain-or-zipped collectives of one group.

    Args:
        g: the group and its timeout.
        mode: `comm.compression`.
        refresh_calls: every how many calls a stream measures its ratio again.
    """

    def __init__(self, g: Group, mode: Compression, refresh_calls: int = 32) -> None:
        self.g = g
        profile = profile_group(g) if mode is Compression.AUTO else None
        if profile is not None and g.rank == 0:
            log.info("compression switcher profile: %s", profile.to_dict())
        self.switcher = Switcher(mode, profile, refresh_calls)
        self.sizes = Sizes(0, 0)
        """Global bytes of the zipped calls since the last `take_sizes`: raw and sent."""

    def all_reduce_sum_(self, flat: torch.Tensor, stream: str) -> None:
        """Sum a 1-D tensor over the group in place, zipped when that is faster."""
        nbytes = flat.numel() * flat.element_size()
        if not self.switcher.use_zipped(Kind.ALL_REDUCE, stream, nbytes):
            work = dist.all_reduce(flat, group=self.g.group, async_op=True)
            self.g.wait([work], f"all-reduce of {stream}")
            self._count_plain(nbytes)
            return
        total, sizes = comms.zipped_all_reduce(flat, self.g)
        flat.copy_(total)
        self._record(stream, sizes)

    def take_sizes(self) -> Sizes:
        """Bytes counted since the last call (whole group), and reset."""
        sizes, self.sizes = self.sizes, Sizes(0, 0)
        return sizes

    def _record(self, stream: str, sizes: Sizes) -> None:
        self.switcher.observe(stream, sizes)
        self.sizes += sizes

    def ring_zipper(self) -> RingZipper:
        """Per-message choices for this rank's ring transfers, sharing the profile."""
        return RingZipper(self.switcher, self.g.rank)

    def _count_plain(self, nbytes: int) -> None:
        """A plain all-reduce moves each rank's bytes uncompressed: raw = sent."""
        total = nbytes * self.g.size
        self.sizes += Sizes(total, total)


class RingZipper:
    """Chooses, per point-to-point ring message, whether it travels zipped.

    A link's choices depend only on the message sizes and on the ratios of its
    earlier zipped messages, which both ends know, so sender and receiver
    always agree. Counts this rank's sent bytes (raw and on the wire).
    """

    def __init__(self, switcher: Switcher, rank: int) -> None:
        self.switcher, self.rank = switcher, rank
        self.raw_bytes = self.wire_bytes = 0

    def zip_send(self, peer: int, tensor: torch.Tensor) -> bool:
        nbytes = tensor.numel() * tensor.element_size()
        zipped = self._decide(self._link(self.rank, peer), tensor, nbytes)
        if not zipped:
            self.raw_bytes += nbytes
            self.wire_bytes += nbytes
        return zipped

    def zip_recv(self, peer: int, buf: torch.Tensor) -> bool:
        return self._decide(self._link(peer, self.rank), buf, buf.numel() * buf.element_size())

    def sent(self, peer: int, tensor: torch.Tensor, wire_bytes: int) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.raw_bytes += nbytes
        self.wire_bytes += wire_bytes
        self.switcher.observe(self._link(self.rank, peer), Sizes(nbytes, wire_bytes))

    def received(self, peer: int, out: torch.Tensor, wire_bytes: int) -> None:
        nbytes = out.numel() * out.element_size()
        self.switcher.observe(self._link(peer, self.rank), Sizes(nbytes, wire_bytes))

    def take(self) -> tuple[int, int]:
        """(raw, wire) bytes this rank sent since the last call; resets."""
        out = (self.raw_bytes, self.wire_bytes)
        self.raw_bytes = self.wire_bytes = 0
        return out

    def _decide(self, link: str, tensor: torch.Tensor, nbytes: int) -> bool:
        if tensor.dtype not in FORMATS or tensor.numel() == 0:
            return False
        return self.switcher.use_zipped(Kind.ALL_TO_ALL, link, nbytes)

    @staticmethod
    def _link(src: int, dst: int) -> str:
        return f"kv {src}->{dst}"
