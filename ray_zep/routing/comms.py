"""Routed transfers: the main thread's sends and receives, and each rank's relay thread.

Every rank runs one relay thread (the CPU analogue of a dedicated communication
stream) that forwards the pieces it proxies while the main thread computes.
Three extra process groups keep each message stream between one kind of sender
and one kind of receiver, so messages between a pair of ranks on a group are
always posted in the same order on both sides:

    dispatch: main thread -> relay   (hop 1, and a source's own inter-node piece)
    relay:    relay -> relay         (hop 2 between two proxies)
    combine:  relay -> main thread   (hop 3, and a proxy's piece for the destination)

and the Comm's own group carries main -> main (a source's piece that goes
straight to the destination).

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

from ray_zep.dist import Comm
from ray_zep.dist.waiting import wait_all
from ray_zep.errors import CommError
from ray_zep.routing.routes import Payload, Route, Transfer


@dataclass(frozen=True)
class RowFormat:
    """Row shapes of one layer call: K/V heads and head dim, and the K/V dtype."""

    kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype
    device: torch.device

    def row_shape(self, transfer: Transfer) -> tuple[int, int, int]:
        u_size = transfer.ulysses
        per_member = self.kv_heads // u_size if u_size <= self.kv_heads else 1
        return (2, per_member, self.head_dim)

    def dtype(self, transfer: Transfer) -> torch.dtype:
        return self.kv_dtype if transfer.payload is Payload.KV else torch.float32

    def empty(self, transfer: Transfer, rows: int) -> torch.Tensor:
        return torch.empty(
            (rows, *self.row_shape(transfer)), dtype=self.dtype(transfer), device=self.device
        )


class Channels:
    """The routing process groups of a rank and its relay thread.

    Created collectively (every rank in the same order) by `open_channels`.
    """

    def __init__(self, main, dispatch, relay, combine, timeout_s: float, rank: int) -> None:
        self.main, self.dispatch, self.relay, self.combine = main, dispatch, relay, combine
        self.timeout_s, self.rank = timeout_s, rank
        self._relay = Relay(self)

    def wait(self, works: list, what: str) -> None:
        wait_all(works, what, self.timeout_s, self.rank)

    def start_relay(self, transfers: Sequence[Transfer], rows: RowFormat) -> None:
        """Hand the relay thread the transfers it proxies in this layer call."""
        self._relay.submit(transfers, rows)

    def finish_relay(self) -> None:
        """Wait until the relay has forwarded this call's pieces; re-raise its error."""
        self._relay.join()


def open_channels(comm: Comm) -> Channels:
    """The routing channels over the Comm's group and its three routing groups.

    Raises:
        CommError: the Comm was built without the routing groups (`GroupNeeds.routing`).
    """
    if comm.groups.routing is None:
        raise CommError("routing needs the routing groups: build the Comm with GroupNeeds")
    return Channels(comm.group, *comm.groups.routing, timeout_s=comm.timeout_s, rank=comm.rank)


def post_send(tensor: torch.Tensor, route: Route, channels: Channels, ops: Counter) -> list:
    """Source side of a routed transfer: hop-1 dispatch and the source's own pieces."""
    works = []
    for proxy, (lo, hi) in zip(route.send_proxies, route.send_ranges, strict=True):
        if proxy != route.src and hi > lo:
            works.append(dist.isend(tensor[lo:hi].contiguous(), proxy, channels.dispatch))
    for piece in route.pieces():
        if piece.sender == route.src:
            group = channels.main if piece.receiver == route.dst else channels.dispatch
            part = tensor[piece.lo : piece.hi].contiguous()
            works.append(dist.isend(part, piece.receiver, group))
    ops["routed"] += len(works)
    return works


def post_recv(buf: torch.Tensor, route: Route, channels: Channels, ops: Counter) -> list:
    """Destination side: its own pieces from the send proxies, then hop-3 from the others."""
    works = []
    for piece in route.pieces():
        if piece.receiver == route.dst:
            group = channels.main if piece.sender == route.src else channels.combine
            works.append(dist.irecv(buf[piece.lo : piece.hi], piece.sender, group))
    for proxy, (lo, hi) in zip(route.recv_proxies, route.recv_ranges, strict=True):
        if proxy != route.dst and hi > lo:
            works.append(dist.irecv(buf[lo:hi], proxy, channels.combine))
    ops["routed"] += len(works)
    return works


class Relay:
    """A daemon thread that forwards the pieces this rank proxies, one layer call at a time."""

    def __init__(self, channels: Channels) -> None:
        self._channels = channels
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._pending = 0
        self._thread: threading.Thread | None = None

    def submit(self, transfers: Sequence[Transfer], rows: RowFormat) -> None:
        if not transfers:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="ray-zep-relay", daemon=True)
            self._thread.start()
        self._jobs.put((tuple(transfers), rows))
        self._pending += 1

    def join(self) -> None:
        while self._pending:
            error = self._done.get()
            self._pending -= 1
            if error is not None:
                raise error

    def _serve(self) -> None:
        while True:
            transfers, rows = self._jobs.get()
            try:
                _relay_call(transfers, rows, self._channels)
                self._done.put(None)
            except BaseException as exc:  # handed to the main thread by join()
                self._done.put(exc if isinstance(exc, CommError) else _as_comm_error(exc))


def _relay_call(transfers: tuple[Transfer, ...], rows: RowFormat, channels: Channels) -> None:
    me = channels.rank
    for _, group in itertools.groupby(transfers, key=lambda t: t.order):
        batch = list(group)
        sends = _forward_dispatched(batch, rows, channels, me)
        sends += _combine_received(batch, rows, channels, me)
        channels.wait(sends, "relay send")


def _forward_dispatched(batch: list[Transfer], rows: RowFormat, channels: Channels, me: int):
    """Stage 1: receive the ranges this rank proxies for sources, send their pieces on."""
    held, works = [], []
    for t in batch:
        route = t.route
        if me == route.src or me not in route.send_proxies:
            continue
        lo, hi = route.send_ranges[route.send_proxies.index(me)]
        if hi == lo:
            continue
        buf = rows.empty(t, hi - lo)
        works.append(dist.irecv(buf, route.src, channels.dispatch))
        held.append((t, lo, buf))
    channels.wait(works, "routed dispatch (hop 1)")
    sends = []
    for t, lo, buf in held:
        for piece in t.route.pieces():
            if piece.sender == me:
                to_dst = piece.receiver == t.route.dst
                group = channels.combine if to_dst else channels.relay
                part = buf[piece.lo - lo : piece.hi - lo].contiguous()
                sends.append(dist.isend(part, piece.receiver, group))
    return sends


def _combine_received(batch: list[Transfer], rows: RowFormat, channels: Channels, me: int):
    """Stage 2: collect the pieces this rank receives for destinations, send each range on."""
    held, works = [], []
    for t in batch:
        route = t.route
        if me == route.dst or me not in route.recv_proxies:
            continue
        lo, hi = route.recv_ranges[route.recv_proxies.index(me)]
        if hi == lo:
            continue
        buf = rows.empty(t, hi - lo)
        for piece in route.pieces():
            if piece.receiver == me:
                group = channels.dispatch if piece.sender == route.src else channels.relay
                works.append(dist.irecv(buf[piece.lo - lo : piece.hi - lo], piece.sender, group))
        held.append((t, buf))
    channels.wait(works, "routed inter-node transfer (hop 2)")
    return [dist.isend(buf, t.route.dst, channels.combine) for t, buf in held]


def _as_comm_error(exc: BaseException) -> CommError:
    return CommError(f"relay thread failed: {type(exc).__name__}: {exc}")
