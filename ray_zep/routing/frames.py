"""Routed messages that say themselves whether they are compressed (`routed_kv`).

With compression on, every message of a routed transfer travels in two parts:

- the frame, whose size every rank knows from the rows it carries: a 16-byte
  head (its kind, plain or zipped) and then the codec's static part, or for a
  plain message as many raw bytes as a static part would hold;
- the tail: the codec's dynamic part (its size in the static part's header), or
  the raw bytes that did not fit in the frame.

So a proxy forwards a message without knowing how its source chose, and without
decoding it when it passes it on whole: a piece is coded once, at its source,
and decoded once, at its destination.

Order: on one group, a pair of ranks pairs messages in the order both post
them. A sender posts a message's frame and tail together; a receiver
(`Mailbox`) posts a frame only once the tail of the message before it on the
same group and peer is posted, so frames and tails pair up in order. The
mailbox's own thread posts each tail as soon as its frame has arrived, not when
the receiving thread comes to wait for it: a sender waiting for its tail to go
out would otherwise wait on whatever the receiver waits for first, and where ranks
wait in different orders (ring steps that differ between ranks) that is a cycle.
"""

from __future__ import annotations

import collections
import datetime
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ray_zep.collectives.codec import blamed_on, compress, decode_exactly, read_header
from ray_zep.collectives.format import static_bytes
from ray_zep.errors import CodecError

HEAD_BYTES = 16
PLAIN, ZIPPED = 0x50, 0x5A
"""The first byte of a frame: its kind."""


def frame_bytes(values: int, dtype: torch.dtype) -> int:
    """Size of the frame of a message of `values` values."""
    return HEAD_BYTES + static_bytes(values, dtype)


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@dataclass
class Framed:
    """One message in its two parts."""

    frame: torch.Tensor
    tail: torch.Tensor
    raw_bytes: int

    @property
    def zipped(self) -> bool:
        return int(self.frame[0]) == ZIPPED

    @property
    def wire_bytes(self) -> int:
        return self.frame.numel() + self.tail.numel()

    def post(self, peer: int, group) -> list:
        """Post both parts to `peer` (global rank) on `group`."""
        works = [dist.isend(self.frame, peer, group)]
        if self.tail.numel():
            works.append(dist.isend(self.tail, peer, group))
        return works


def frame(tensor: torch.Tensor, zipped: bool) -> Framed:
    """`tensor` as a message, compressed or not."""
    values, raw = tensor.numel(), _raw(tensor)
    out = torch.empty(frame_bytes(values, tensor.dtype), dtype=torch.uint8, device=tensor.device)
    out[:HEAD_BYTES] = 0
    if zipped:
        compressed = compress(tensor)
        out[0] = ZIPPED
        out[HEAD_BYTES:] = compressed.static
        return Framed(out, compressed.dynamic, raw.numel())
    out[0] = PLAIN
    held = min(raw.numel(), out.numel() - HEAD_BYTES)
    out[HEAD_BYTES : HEAD_BYTES + held] = raw[:held]
    return Framed(out, raw[held:], raw.numel())


def tail_bytes(head: torch.Tensor, values: int, dtype: torch.dtype) -> int:
    """Size of the tail that follows `head` (a received frame).

    Raises:
        CodecError: the frame is of no known kind, or its static part is damaged.
    """
    kind = int(head[0])
    if kind == ZIPPED:
        return read_header(head[HEAD_BYTES:]).dynamic_bytes
    if kind == PLAIN:
        raw = values * torch.empty((), dtype=dtype).element_size()
        return max(0, raw - (head.numel() - HEAD_BYTES))
    raise CodecError(f"a routed frame of unknown kind {kind:#x} (damaged in transit?)")


def unframe(message: Framed, out: torch.Tensor) -> None:
    """Write the message's values into `out` (contiguous, of the sent shape's size).

    Raises:
        CodecError: a damaged zipped message.
    """
    if message.zipped:
        static = message.frame[HEAD_BYTES:]
        values = decode_exactly(static, message.tail, out.numel())
        out.view(-1).copy_(values)
        return
    if not out.is_contiguous():
        raise CodecError("a routed message's receive buffer must be contiguous")
    raw = _raw(out)
    held = min(raw.numel(), message.frame.numel() - HEAD_BYTES)
    raw[:held] = message.frame[HEAD_BYTES : HEAD_BYTES + held]
    raw[held:] = message.tail


class FramedRecv:
    """A routed message being received into `out` (a `wait_all` handle).

    Args:
        out: the rows it carries (contiguous).
        peer, group: where it comes from.
        box: the receiving thread's mailbox.
        source: who sends it, for errors.
        decode: write the values into `out` (False: only forwarded whole).
    """

    def __init__(self, out: torch.Tensor, peer: int, group, box: Mailbox, source: str, decode):
        self.out, self.peer, self.group, self.box = out, peer, group, box
        self.source, self.decode = source, decode
        self.head = out.new_empty(frame_bytes(out.numel(), out.dtype), dtype=torch.uint8)
        self.tail: torch.Tensor | None = None
        self.works: list = []
        self.tail_posted = threading.Event()
        self.error: BaseException | None = None
        box.add(self)

    def post_head(self) -> None:
        self.works = [dist.irecv(self.head, self.peer, self.group)]

    def wait_head(self) -> None:
        """Wait for the frame (its lane's thread); an error is kept for `wait`."""
        try:
            for work in self.works:
                work.wait()
        except BaseException as exc:
            self.error = exc

    def post_tail(self) -> None:
        """Post the receive of the tail the arrived frame announces (its lane's thread)."""
        try:
            if self.error is None:
                with blamed_on(self.source):
                    size = tail_bytes(self.head, self.out.numel(), self.out.dtype)
                self.tail = self.head.new_empty(size)
                self.works = [dist.irecv(self.tail, self.peer, self.group)] if size else []
        except BaseException as exc:  # handed to the receiving thread by `wait`
            self.error = exc
        if self.error is not None:
            self.works = []
        self.tail_posted.set()

    def wait(self, timeout=None) -> bool:
        self.box.reach(self, timeout)
        for work in self.works:
            work.wait(timeout=timeout)
        self.works = []
        if self.decode:
            with blamed_on(self.source):
                unframe(self.message(), self.out)
        return True

    def message(self) -> Framed:
        """What arrived, as it arrived (after `wait`)."""
        raw = self.out.numel() * self.out.element_size()
        return Framed(self.head, self.tail, raw)


class _Lane:
    """The messages from one peer on one group, in the order they were posted, and the
    thread that posts each one's tail once its frame has arrived, then the next frame."""

    def __init__(self) -> None:
        self.queue: collections.deque[FramedRecv] = collections.deque()
        self.changed = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._serve, name="ray-zep-mailbox", daemon=True)
        self.thread.start()

    def close(self, timeout_s: float) -> None:
        """Stop the thread once its lane is empty (a message still waiting for its frame
        keeps it: the backend's receive cannot be cancelled)."""
        with self.changed:
            self.closed = True
            self.changed.notify()
        self.thread.join(timeout_s)

    def add(self, recv: FramedRecv) -> None:
        with self.changed:
            if not self.queue:
                recv.post_head()
            self.queue.append(recv)
            self.changed.notify()

    def _serve(self) -> None:
        while True:
            with self.changed:
                while not self.queue and not self.closed:
                    self.changed.wait()
                if not self.queue:
                    return  # closed
                first = self.queue[0]
            first.wait_head()  # blocks this lane alone, never the receiving thread
            with self.changed:
                first.post_tail()
                self.queue.popleft()
                if self.queue:
                    self.queue[0].post_head()


class Mailbox:
    """One receiving thread's routed messages whose tails are not posted yet, per
    (group, peer) lane, in the order they were posted; only the first of a lane has its
    frame posted. Each lane's thread posts a tail once its frame has arrived (module
    docstring); the backends' receive handles complete only when waited on, so each lane
    waits on its own."""

    def __init__(self) -> None:
        self._lanes: dict[tuple[int, int], _Lane] = {}

    def add(self, recv: FramedRecv) -> None:
        key = (id(recv.group), recv.peer)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane()
        lane.add(recv)

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop every lane's thread (the run is over; `timeout_s` each at most)."""
        for lane in self._lanes.values():
            lane.close(timeout_s)
        self._lanes.clear()

    def reach(self, recv: FramedRecv, timeout) -> None:
        """Wait until `recv`'s tail is posted (its frame has arrived).

        Raises:
            RuntimeError: the frame did not arrive within `timeout` (`wait_all` names it).
            Whatever receiving the frame raised (a backend error, a damaged frame).
        """
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds()
        if not recv.tail_posted.wait(timeout):
            raise RuntimeError(f"timed out waiting for {recv.source}")
        if recv.error is not None:
            raise recv.error
