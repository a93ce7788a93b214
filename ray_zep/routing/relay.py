"""Routed transfers: the main thread's sends and receives, and each rank's relay thread.

Every rank runs one relay thread (the CPU analogue of a dedicated communication
stream) that forwards the pieces it proxies while the main thread computes.
Four extra process groups keep each message stream between one kind of sender
and one kind of receiver, so messages between a pair of ranks on a group are
always posted in the same order on both sides:

    dispatch: main thread -> relay   (hop 1, and a source's own inter-node piece)
    relay:    relay -> relay         (hop 2 between two proxies)
    combine:  relay -> main thread   (hop 3, and a proxy's piece for the destination)
    direct:   main -> main           (a source's piece that goes straight to the destination)

The Comm's own group carries only the plan's direct ring transfers: framed, a routed
message's receives are posted by the receiving thread's mailbox (`frames.Mailbox`), and
on a group of their own they cannot take the place of a direct ring receive from the
same peer.

With `comm.compression` and the `routed_kv` stream, every message is framed
(`ray_zep.routing.frames`): the source picks plain or zipped per message, a
proxy forwards a piece it passes on whole as it came, and re-frames (in the
kind it received) only what it cuts or joins.

Ordering rule (why this cannot deadlock): every transfer has a key (layer call,
item index, ring step, payload) and a stage: 0 the main threads post (sources
post hop 1, destinations post their receives), 1 the send proxies receive hop 1
and post hop 2, 2 the receive proxies receive hop 2 and post hop 3, 3 the
destination waits. Main threads and relays handle keys in increasing order and
all of a key's stage 1 before its stage 2; a message posted at stage k is only
waited for at a stage > k of the same key or at a later key, and nobody blocks
before posting what a lower key or stage needs. So the lowest blocked wait
always has its message posted: there is no cycle.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ray_zep.collectives.adaptive import RingZipper
from ray_zep.distributed import Comm
from ray_zep.distributed.waiting import wait_all
from ray_zep.errors import CodecError, CommError
from ray_zep.options import CompressionStream
from ray_zep.routing.frames import Framed, FramedRecv, Mailbox, frame
from ray_zep.routing.routes import Payload, Route, Transfer

STREAM = CompressionStream.ROUTED_KV.value


@dataclass(frozen=True)
class RowFormat:
    """Row shapes of one layer call: K/V heads and head dim, the K/V dtype and the dtype
    dK/dV accumulators travel in."""

    kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype
    device: torch.device
    dkv_dtype: torch.dtype = torch.float32

    def row_shape(self, transfer: Transfer) -> tuple[int, int, int]:
        u_size = transfer.ulysses
        per_member = self.kv_heads // u_size if u_size <= self.kv_heads else 1
        return (2, per_member, self.head_dim)

    def dtype(self, transfer: Transfer) -> torch.dtype:
        return self.kv_dtype if transfer.payload is Payload.KV else self.dkv_dtype

    def empty(self, transfer: Transfer, rows: int) -> torch.Tensor:
        return torch.empty(
            (rows, *self.row_shape(transfer)), dtype=self.dtype(transfer), device=self.device
        )


class Channels:
    """The routing process groups of a rank and its relay thread.

    Created collectively (every rank in the same order) by `open_channels`.

    Attributes:
        zipper: the source's per-message choice, plain or zipped (None: messages
            are not framed: compression off or `routed_kv` not listed).
        inbox: the main thread's framed receives.
    """

    def __init__(
        self,
        dispatch,
        relay,
        combine,
        direct,
        timeout_s: float,
        rank: int,
        zipper: RingZipper | None = None,
    ) -> None:
        self.dispatch, self.relay, self.combine, self.direct = dispatch, relay, combine, direct
        self.timeout_s, self.rank = timeout_s, rank
        self.zipper = zipper if zipper is not None and STREAM in zipper.streams else None
        self.inbox = Mailbox()
        self._relay = Relay(self)

    @property
    def framed(self) -> bool:
        return self.zipper is not None

    def close(self) -> None:
        """Stop this rank's relay and mailbox threads (the run is over): a process that
        builds another trainer (an elastic restart, tests) keeps none of them."""
        self._relay.close()
        self.inbox.close()

    def wait(self, works: list, what: str) -> None:
        wait_all(works, what, self.timeout_s, self.rank)

    def send(self, part: torch.Tensor, peer: int, group) -> list:
        """Post a source's message (framed: plain or zipped as the zipper picks)."""
        z = self.zipper
        if z is None:
            return [dist.isend(part.contiguous(), peer, group)]
        message = frame(part, z.choose(STREAM, peer, part))
        z.framed_sent(STREAM, peer, message.raw_bytes, message.wire_bytes, message.zipped)
        return message.post(peer, group)

    def receive(self, out: torch.Tensor, peer: int, group, box: Mailbox, decode: bool = True):
        """A handle for a message into `out` from `peer` (for `wait`)."""
        if not self.framed:
            return dist.irecv(out, peer, group)
        source = f"{STREAM}: the message from rank {peer}"
        return FramedRecv(out, peer, group, box, source, decode)

    def start_relay(self, transfers: Sequence[Transfer], rows: RowFormat) -> None:
        """Hand the relay thread the transfers it proxies in this layer call."""
        self._relay.submit(transfers, rows)

    def finish_relay(self) -> None:
        """Wait until the relay has forwarded this call's pieces; re-raise its error.
        Counts the relay's framed messages in the zipper's tally."""
        for raw, wire, zipped in self._relay.join():
            self.zipper.tally.add(STREAM, raw, wire, zipped)


def open_channels(comm: Comm, zipper: RingZipper | None = None) -> Channels:
    """The routing channels over the Comm's four routing groups.

    Args:
        zipper: `comm.compression`'s per-message choices (None: off).

    Raises:
        CommError: the Comm was built without the routing groups (`GroupNeeds.routing`).
    """
    if comm.groups.routing is None:
        raise CommError("routing needs the routing groups: build the Comm with GroupNeeds")
    return Channels(*comm.groups.routing, timeout_s=comm.timeout_s, rank=comm.rank, zipper=zipper)


def post_send(tensor: torch.Tensor, route: Route, channels: Channels, ops: Counter) -> list:
    """Source side of a routed transfer: hop-1 dispatch and the source's own pieces."""
    works, messages = [], 0
    for proxy, (lo, hi) in zip(route.send_proxies, route.send_ranges, strict=True):
        if proxy != route.src and hi > lo:
            works += channels.send(tensor[lo:hi], proxy, channels.dispatch)
            messages += 1
    for piece in route.pieces():
        if piece.sender == route.src:
            group = channels.direct if piece.receiver == route.dst else channels.dispatch
            works += channels.send(tensor[piece.lo : piece.hi], piece.receiver, group)
            messages += 1
    ops["routed"] += messages
    return works


def post_recv(buf: torch.Tensor, route: Route, channels: Channels, ops: Counter) -> list:
    """Destination side: its own pieces from the send proxies, then hop-3 from the others."""
    works, box = [], channels.inbox
    for piece in route.pieces():
        if piece.receiver == route.dst:
            group = channels.direct if piece.sender == route.src else channels.combine
            works.append(channels.receive(buf[piece.lo : piece.hi], piece.sender, group, box))
    for proxy, (lo, hi) in zip(route.recv_proxies, route.recv_ranges, strict=True):
        if proxy != route.dst and hi > lo:
            works.append(channels.receive(buf[lo:hi], proxy, channels.combine, box))
    ops["routed"] += len(works)
    return works


class Relay:
    """A daemon thread that forwards the pieces this rank proxies, one layer call at a time.

    Framed, it keeps its own mailbox and lists the (raw, wire, zipped) sizes of
    the messages it sends; `join` hands the list to the main thread.
    """

    def __init__(self, channels: Channels) -> None:
        self._channels = channels
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._hop = Hop(channels, Mailbox(), [])

    def submit(self, transfers: Sequence[Transfer], rows: RowFormat) -> None:
        if not transfers:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="ray-zep-relay", daemon=True)
            self._thread.start()
        self._jobs.put((tuple(transfers), rows))
        self._pending += 1

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the thread (after the calls submitted) and its mailbox's lanes."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout_s)
            self._thread = None
        self._hop.box.close(timeout_s)

    def join(self) -> list[tuple[int, int, bool]]:
        """Wait for every submitted call; the sizes of the framed messages sent."""
        while self._pending:
            error = self._done.get()
            self._pending -= 1
            if error is not None:
                raise error
        sent, self._hop.sent = self._hop.sent, []
        return sent

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:  # None: `close`
            transfers, rows = job
            try:
                _relay_call(transfers, rows, self._hop)
                self._done.put(None)
            except BaseException as exc:  # handed to the main thread by join()
                typed = isinstance(exc, (CommError, CodecError))
                self._done.put(exc if typed else _as_comm_error(exc))


@dataclass
class Hop:
    """The relay thread's side of its messages: receive handles and onward sends."""

    channels: Channels
    box: Mailbox
    sent: list[tuple[int, int, bool]]

    def receive(self, out: torch.Tensor, peer: int, group, decode: bool = True):
        return self.channels.receive(out, peer, group, self.box, decode)

    def pass_on(self, arrived: list, part: torch.Tensor, peer: int, group) -> list:
        """Send `part`, made of what `arrived` (receive handles, after their wait):
        one framed message passed on whole goes as it came; anything else is framed
        again, zipped if any of it arrived zipped."""
        if not self.channels.framed:
            return [dist.isend(part.contiguous(), peer, group)]
        messages = [handle.message() for handle in arrived]
        if len(messages) == 1 and messages[0].raw_bytes == part.numel() * part.element_size():
            return self._post(messages[0], peer, group)
        return self._post(frame(part, any(m.zipped for m in messages)), peer, group)

    def _post(self, message: Framed, peer: int, group) -> list:
        self.sent.append((message.raw_bytes, message.wire_bytes, message.zipped))
        return message.post(peer, group)


def _relay_call(transfers: tuple[Transfer, ...], rows: RowFormat, hop: Hop) -> None:
    me = hop.channels.rank
    for _, group in itertools.groupby(transfers, key=lambda t: t.order):
        batch = list(group)
        sends = _forward_dispatched(batch, rows, hop, me)
        sends += _combine_received(batch, rows, hop, me)
        hop.channels.wait(sends, "relay send")


def _proxied(batch: list[Transfer], rows: RowFormat, me: int, sending: bool):
    """(transfer, first row, buffer, pieces, whether the pieces are the whole range) of
    each transfer of `batch` this rank proxies: for its source (`sending`: the pieces it
    sends on) or for its destination (the pieces it receives)."""
    for t in batch:
        route = t.route
        end, proxies, ranges = (
            (route.src, route.send_proxies, route.send_ranges)
            if sending
            else (route.dst, route.recv_proxies, route.recv_ranges)
        )
        if me == end or me not in proxies:
            continue
        lo, hi = ranges[proxies.index(me)]
        if hi == lo:
            continue
        side = "sender" if sending else "receiver"
        pieces = [p for p in route.pieces() if getattr(p, side) == me]
        whole = [(p.lo, p.hi) for p in pieces] == [(lo, hi)]
        yield t, lo, rows.empty(t, hi - lo), pieces, whole


def _forward_dispatched(batch: list[Transfer], rows: RowFormat, hop: Hop, me: int):
    """Stage 1: receive the ranges this rank proxies for sources, send their pieces on."""
    channels, held, works = hop.channels, [], []
    for t, lo, buf, mine, whole in _proxied(batch, rows, me, sending=True):
        works.append(hop.receive(buf, t.route.src, channels.dispatch, decode=not whole))
        held.append((t, lo, buf, mine, works[-1]))
    channels.wait(works, "routed dispatch (hop 1)")
    sends = []
    for t, lo, buf, mine, arrived in held:
        for piece in mine:
            to_dst = piece.receiver == t.route.dst
            group = channels.combine if to_dst else channels.relay
            part = buf[piece.lo - lo : piece.hi - lo]
            sends += hop.pass_on([arrived], part, piece.receiver, group)
    return sends


def _combine_received(batch: list[Transfer], rows: RowFormat, hop: Hop, me: int):
    """Stage 2: collect the pieces this rank receives for destinations, send each range on."""
    channels, held, works = hop.channels, [], []
    for t, lo, buf, pieces, whole in _proxied(batch, rows, me, sending=False):
        arrived = []
        for piece in pieces:
            group = channels.dispatch if piece.sender == t.route.src else channels.relay
            part = buf[piece.lo - lo : piece.hi - lo]
            arrived.append(hop.receive(part, piece.sender, group, decode=not whole))
        works += arrived
        held.append((t, buf, arrived))
    channels.wait(works, "routed inter-node transfer (hop 2)")
    sends = []
    for t, buf, arrived in held:
        sends += hop.pass_on(arrived, buf, t.route.dst, channels.combine)
    return sends


def _as_comm_error(exc: BaseException) -> CommError:
    return CommError(f"relay thread failed: {type(exc).__name__}: {exc}")
