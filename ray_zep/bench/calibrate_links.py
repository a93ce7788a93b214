"""The links of a CPU virtual cluster, measured the way its ranks use them.

A virtual cluster runs one single-threaded process per rank, often more processes
than cores. A message between two of them then costs far more than a ping-pong
between two idle processes shows: the receiver is computing, or waiting for a
core, when the message arrives. So the ranks here do what training ranks do:
each computes a burst of matmuls, then exchanges a message with its ring
neighbours (`isend`/`irecv`, as the attention engine does), or joins an
all-gather (as FSDP2 does); the time an iteration takes beyond the compute-only
loop is the message's cost. Fitted over message sizes, `seconds = latency +
bytes / bandwidth`, per message and per all-gather step. A message posted before
the burst and waited for after it should hide behind the burst; what it still
costs, against what it costs after the burst, is how much of a transfer the ranks'
compute cannot overlap (`contention`: the sender and receiver need the cores
that compute). The share of a core each rank gets meanwhile is probed around
these measurements (`ray_zep.core_share`).

A message's cost also grows with the compute between two messages: ranks that
computed longer finish further apart (the cores are time-sliced among more ranks
than cores), and the first to finish waits for the last. On a 2-core VM with 4
ranks, the smallest message cost 1.8-2.1 ms after 0-2 ms of compute, 2.5-3.2 ms
after 4 ms and 3.4-3.9 ms after 8-16 ms. So the smallest message is also measured
after shorter bursts (`LATENCY_BURSTS`): `latency_curve` gives the latency by the
compute between messages, as the attention engine's ring steps compute anywhere
from a fraction of a millisecond to tens of them between theirs.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from ray_zep.bench.local_ranks import start_ranks
from ray_zep.distributed.launch import free_port

MESSAGE_BYTES = (1 << 12, 1 << 18, 1 << 21)
"""Sizes of the measured messages (per rank)."""
BURST_MATMULS = 12
"""Matmuls of 256 x 256 x 256 per compute burst (a few ms on one core)."""
LATENCY_BURSTS = (0, 3)
"""Matmuls per burst of the extra measurements of the smallest message (besides
`BURST_MATMULS`): the latency after little compute."""
SHORT_BURST_ITERATIONS = 3
"""Iterations of a short burst's loop per iteration of the standard one: the same order
of measured time, a message there costing about as much as the burst."""
ROUNDS = 3
"""Measurements whose per-point median is fitted: four back to back on a 2-core VM fitted
a message at 2.2-3.4 ms + bytes / 1.1-3.4 GB/s, and one calibration's message latency
moves every engine mode's prediction."""


@dataclass(frozen=True)
class LinkPoint:
    """Extra seconds one iteration took with a message of `nbytes` per rank, after a
    compute burst of `burst` matmuls that took `compute_s` alone (recorded for the
    "message_after" points of `LATENCY_BURSTS`)."""

    op: str
    nbytes: int
    seconds: float
    burst: int = BURST_MATMULS
    compute_s: float = 0.0


def _burst(a: torch.Tensor, b: torch.Tensor, matmuls: int) -> None:
    for _ in range(matmuls):
        a @ b


def _loop(
    iterations: int, exchange, overlapped: bool = False, matmuls: int = BURST_MATMULS
) -> float:
    """Seconds per iteration of a compute burst of `matmuls` followed by `exchange()`
    (None: none), or with `overlapped`, of a burst between posting the exchange and
    waiting for it."""
    import torch.distributed as dist

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iterations):
        if overlapped:
            handles = exchange()
            _burst(a, b, matmuls)
            for handle in handles:
                handle.wait()
            continue
        _burst(a, b, matmuls)
        if exchange is not None:
            for handle in exchange():
                handle.wait()
    elapsed = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed) / iterations


def _ring_exchange(rank: int, world: int, send: torch.Tensor, recv: torch.Tensor):
    import torch.distributed as dist

    def exchange() -> list:
        return [dist.irecv(recv, (rank - 1) % world), dist.isend(send, (rank + 1) % world)]

    return exchange


def _gather(send: torch.Tensor, out: torch.Tensor):
    from ray_zep.distributed.group import all_gather_single

    def exchange() -> list:
        all_gather_single(out, send)
        return []

    return exchange


def _worker(rank: int, world: int, port: int, iterations: int, result) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    _loop(2, None)  # warm-up: page in, first collective
    alone = _loop(iterations, None)
    for nbytes in MESSAGE_BYTES:
        send = torch.zeros(nbytes // 4)
        recv = torch.zeros_like(send)
        ring = _loop(iterations, _ring_exchange(rank, world, send, recv))
        hidden = _loop(iterations, _ring_exchange(rank, world, send, recv), overlapped=True)
        gathered = torch.zeros(world * send.numel())
        gather = _loop(iterations, _gather(send, gathered))
        if rank == 0:
            result.append(("message", nbytes, max(0.0, ring - alone)))
            result.append(("overlapped_message", nbytes, max(0.0, hidden - alone)))
            result.append(("all_gather_step", nbytes, max(0.0, gather - alone) / (world - 1)))
            result.append(("burst", nbytes, alone))
    send = torch.zeros(MESSAGE_BYTES[0] // 4)
    recv = torch.zeros_like(send)
    short = iterations * SHORT_BURST_ITERATIONS
    for matmuls in LATENCY_BURSTS:
        burst = _loop(short, None, matmuls=matmuls)
        ring = _loop(short, _ring_exchange(rank, world, send, recv), matmuls=matmuls)
        if rank == 0:
            extra = max(0.0, ring - burst)
            result.append(("message_after", MESSAGE_BYTES[0], extra, matmuls, burst))
    dist.barrier()  # no rank tears the group down while a peer still uses it
    dist.destroy_process_group()


def measure_links(ranks: int, iterations: int = 30, rounds: int = ROUNDS) -> list[LinkPoint]:
    """Message and all-gather costs among `ranks` single-threaded processes (module
    docstring), each point the median of `rounds` measurements.

    Raises:
        ValueError: fewer than 2 ranks.
    """
    import torch.multiprocessing as mp

    if ranks < 2:
        raise ValueError(f"measuring links needs >= 2 ranks, got {ranks}")
    measured = []
    for _ in range(rounds):
        with mp.Manager() as manager:
            result = manager.list()
            args = (ranks, free_port(), iterations, result)
            start_ranks(_worker, args, ranks)
            measured.extend(LinkPoint(*row) for row in result)
    return median_points(measured)


def median_points(points: list[LinkPoint]) -> list[LinkPoint]:
    """One point per (op, bytes, burst): the median seconds (and compute) of those
    measured, in first-seen order."""
    seen: dict[tuple, list[LinkPoint]] = {}
    for p in points:
        seen.setdefault((p.op, p.nbytes, p.burst), []).append(p)
    return [
        dataclasses.replace(
            ps[0],
            seconds=float(np.median([p.seconds for p in ps])),
            compute_s=float(np.median([p.compute_s for p in ps])),
        )
        for ps in seen.values()
    ]


def fit_link(points: list[LinkPoint], op: str) -> tuple[float, float]:
    """(latency seconds >= 0, bytes/s) of `seconds = latency + bytes / bandwidth` for `op`."""
    chosen = [p for p in points if p.op == op]
    x = np.array([p.nbytes for p in chosen], dtype=float)
    y = np.array([p.seconds for p in chosen])
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:  # bandwidth beyond what the sizes resolve: latency only
        return float(max(y.mean(), 0.0)), float("inf")
    if intercept < 0:
        slope, intercept = float(np.dot(x, y) / np.dot(x, x)), 0.0
    return float(intercept), 1.0 / float(slope)


def contention(points: list[LinkPoint]) -> float:
    """Compute time factor while messages move (`ComputeRates.contention`): 1 + the part
    of a message's cost that overlapping it with compute does not hide, in [1, 2]."""
    exposed = sum(p.seconds for p in points if p.op == "message")
    hidden = sum(p.seconds for p in points if p.op == "overlapped_message")
    return 1.0 + min(1.0, hidden / exposed) if exposed > 0 else 1.0


def latency_curve(
    points: list[LinkPoint], latency: float, bandwidth: float
) -> tuple[tuple[float, float], ...]:
    """(seconds of compute between two messages, a message's latency) in rising compute:
    the smallest message after each short burst less its bytes' time, and `latency` (the
    fit after the standard burst) at the standard burst's compute; empty where the short
    bursts were not measured."""
    after = [p for p in points if p.op == "message_after"]
    standard = [p.seconds for p in points if p.op == "burst"]
    if not after or not standard:
        return ()
    curve = [(p.compute_s, max(0.0, p.seconds - p.nbytes / bandwidth)) for p in after]
    curve.append((float(np.median(standard)), latency))
    return tuple(sorted(curve))
