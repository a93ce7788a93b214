"""The share of a core each rank of a CPU virtual cluster gets right now.

A virtual cluster runs more single-threaded rank processes than the machine has
cores, and a virtual machine's cores are not always all there: its host may run
other guests on them. On a 2-core VM, 4 busy processes got 0.26 to 0.52 of a core
each in three calibrations within 20 minutes. A prediction made with the share
measured at calibration time is then off by up to 2x for a run made later, so
`ray-zep bench train` and `bench validate` probe the share just before and just
after each run and predict that run with their mean.

The probe: `ranks` processes run the same CPU-bound loop at once; the share is the
time of the loop in one process alone over the mean time of the concurrent ones.
One such round takes a tenth of a second, and right after a Ray run some rounds
read 0.44-0.52 where most read 0.55-0.65 (a 2-core VM, 4 ranks): the processes a
run leaves to wind down take a core for a moment. So a probe is the median of
`ROUNDS` rounds spread over a few seconds (`PAUSE_S` apart). With a single burst
of 3 rounds, the shares probed around the 14 runs of one `bench validate` ranged
0.53-0.64, and the run probed lowest was predicted at 0.77 of measured (0.90 at
the calibration's share); spread out, the probes around four runs agreed within
0.585-0.610.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

PROBE_ITERATIONS = 1_000_000
"""Loop iterations per process (about 40 ms on one core of a 2020s x86-64 server)."""
ROUNDS = 7
PAUSE_S = 0.3
"""Seconds between two rounds of a probe (module docstring)."""


def _loop(iterations: int, results) -> None:
    started = time.perf_counter()
    total = 0
    for i in range(iterations):
        total += i * i
    results.put(time.perf_counter() - started)


def _timed(processes: int, iterations: int) -> float:
    """Mean seconds of the loop over `processes` concurrent processes."""
    context = mp.get_context("fork")  # no torch state is touched in the children
    results = context.Queue()
    workers = [context.Process(target=_loop, args=(iterations, results)) for _ in range(processes)]
    for worker in workers:
        worker.start()
    times = [results.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    return statistics.fmean(times)


def probe_core_share(
    ranks: int, iterations: int = PROBE_ITERATIONS, pause: float = PAUSE_S
) -> float:
    """Share of a core each of `ranks` busy processes gets now (median of `ROUNDS`
    rounds, `pause` seconds apart), at most 1.

    Raises:
        ValueError: `ranks` < 1.
    """
    if ranks < 1:
        raise ValueError(f"probing the core share needs >= 1 rank, got {ranks}")
    shares = []
    for round_index in range(ROUNDS):
        if round_index:
            time.sleep(pause)
        alone = _timed(1, iterations)
        together = _timed(ranks, iterations)
        shares.append(min(1.0, alone / together))
    return statistics.median(shares)


def while_probed(ranks: int, work: Callable[[], T]) -> tuple[T, float]:
    """`work()`'s result and the share of a core each of `ranks` processes got around it:
    the mean of a probe just before and one just after."""
    before = probe_core_share(ranks)
    result = work()
    return result, (before + probe_core_share(ranks)) / 2
