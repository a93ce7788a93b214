"""The share of a core each rank of a CPU virtual cluster gets right now.

A virtual cluster runs more single-threaded rank processes than the machine has
cores, and a virtual machine's cores are not always all there: its host may run
other guests on them. On a 2-core VM, 4 busy processes got 0.26 to 0.52 of a core
each in three calibrations within 20 minutes. A prediction made with the share
measured at calibration time is then off by up to 2x for a run made later, so
`ray-zep bench train` and `bench validate` probe the share just before and just
after each run and predict that run from them (below).

The probe runs what the ranks run: the model's own training step (forward and
backward of every layer, with the kernel training selects for its attention, on
`TOKENS` packed tokens) in `ranks` processes at once. The share is the step's
seconds in one process alone, timed once at calibration (`Calibration.alone_step_s`,
where the kernels' rates were timed alone too), over its mean seconds in those
processes now. A probe that ran a Python loop instead read a share the model's
kernels did not get: on a 2-core AMD EPYC VM, 4 processes stepping the model each
ran at 0.47-0.49 of the alone rate while the loop read 0.57-0.58, and over 12
probes 4 concurrent steps varied by 3.7% (coefficient of variation) while the
loop's share varied by 5%, not with them; of the three runs it probed highest
(0.76-0.81 of a core, the day's others 0.62-0.71), two measured 15% and 39% slower
than the same modes an hour before.

A probe reads a couple of seconds of a run that lasts a minute or more, and the host's
lending moves within seconds: around the 14 runs of one `bench validate` the probes
read 0.37-0.50 of a core, and predicting each run at its probes put 2 of 14 outside
20% (the two probed at 0.40-0.41 measured within 6% of the same modes in the validate
before), where the calibration's share put none. A host that lends less for minutes
moves both probes around a run; a moment's dip moves one. So a run is predicted at
the median of three readings: the calibration's share and the probes just before and
just after the run.

The stepping processes are spawned once and kept, idle between probes (each imports
torch, builds the model and takes a warm-up step in seconds); a round times `STEPS`
steps, and a probe is the median of `ROUNDS` rounds `PAUSE_S` apart.

Right after a Ray run, the processes it leaves wind down for about a second, taking
half the machine in its first half (measured on a 2-core VM), and a probe taken then
reads them as a smaller share: after 5 of 6 runs of a `--quick` validate, the probe
read 6-25% below the one before the run, and the probe before the next run, seconds
later, read as before again.
So a probe first waits, at most `QUIET_MAX_S`, until the machine's CPUs are less than
`QUIET_BUSY` busy over `QUIET_WINDOW_S` (`wait_until_quiet`).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import queue
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from ray_zep.model_shapes import ModelShape

T = TypeVar("T")

TOKENS = 1024
"""Tokens of the timed step (packed)."""
SEQUENCE = 256
"""Length of each packed sequence."""
STEPS = 2
"""Steps timed per process and round."""
ROUNDS = 3
"""Rounds of a probe around a run."""
CALIBRATION_ROUNDS = 5
"""Rounds, alternating one process alone and all at once, that time the step alone."""
PAUSE_S = 0.3
QUIET_BUSY = 0.15
"""Busy fraction of the machine's CPUs under which a probe starts."""
QUIET_WINDOW_S = 0.25
QUIET_MAX_S = 4.0
"""Longest a probe waits for the machine to be quiet (then probes anyway): on a machine
busy with other work the 12 probes of a `--quick` validate wait under a minute."""
PROC_STAT = "/proc/stat"
TIMEOUT_S = 300.0
"""Longest a probe may take (its processes are spawned on the first)."""


def _step_fn(shape: ModelShape):
    """A training step of the model (forward, backward) on `TOKENS` packed tokens."""
    from ray_zep.attention.kernels import select_kernel
    from ray_zep.attention.varlen import PackedSeqs
    from ray_zep.model.llama import Transformer

    torch.manual_seed(0)
    model = Transformer(shape)
    ids = torch.randint(0, shape.vocab_size, (TOKENS,))
    positions = torch.arange(TOKENS) % SEQUENCE
    seqs = PackedSeqs.from_lengths([SEQUENCE] * (TOKENS // SEQUENCE))
    kernel = select_kernel("auto", torch.device("cpu"), torch.float32)

    def step() -> None:
        F.cross_entropy(model(ids, positions, seqs, kernel), ids).backward()

    step()  # warm-up: allocator, first kernels
    return step


def _timed(step) -> float:
    started = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - started) / STEPS


def _serve(rank: int, shape: ModelShape, commands, barrier, results) -> None:
    """A stepping process: builds the model, then times rounds on request until None."""
    torch.set_num_threads(1)
    step = _step_fn(shape)
    while (command := commands.get()) is not None:
        rounds, alone = command
        for round_index in range(rounds):
            if alone:
                barrier.wait()
                if rank == 0:
                    results.put(("alone", round_index, _timed(step)))
            elif round_index and rank == 0:
                time.sleep(PAUSE_S)
            barrier.wait()
            results.put(("together", round_index, _timed(step)))
            barrier.wait()


class _Steppers:
    """`ranks` processes that hold the model and step it on request: spawned once (a
    process imports torch and builds the model in seconds) and idle, blocked on their
    command queues, between probes."""

    def __init__(self, shape: ModelShape, ranks: int) -> None:
        context = mp.get_context("spawn")
        self.ranks = ranks
        self._barrier = context.Barrier(ranks)
        self._results = context.Queue()
        self._commands = [context.Queue() for _ in range(ranks)]
        self._processes = [
            context.Process(
                target=_serve,
                args=(rank, shape, self._commands[rank], self._barrier, self._results),
                daemon=True,
            )
            for rank in range(ranks)
        ]
        for process in self._processes:
            process.start()

    def run(self, rounds: int, alone: bool) -> list[tuple[str, int, float]]:
        for commands in self._commands:
            commands.put((rounds, alone))
        expected = rounds * (self.ranks + int(alone))
        records, deadline = [], time.monotonic() + TIMEOUT_S
        while len(records) < expected:
            try:
                records.append(self._results.get(timeout=1.0))
            except queue.Empty:
                dead = [p.exitcode for p in self._processes if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = f"exit codes {dead}" if dead else f"over {TIMEOUT_S:.0f} s"
                    raise RuntimeError(f"probing the core share failed: {why}") from None
        return records

    def close(self) -> None:
        for commands, process in zip(self._commands, self._processes, strict=True):
            if process.is_alive():
                commands.put(None)
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


_STEPPERS: dict[tuple[ModelShape, int], _Steppers] = {}


@atexit.register
def close_steppers() -> None:
    """Stop every stepping process this process started."""
    while _STEPPERS:
        _STEPPERS.popitem()[1].close()


def _cpu_ticks() -> tuple[int, int] | None:
    """Busy and total ticks of all CPUs since boot (Linux `/proc/stat`), None elsewhere."""
    try:
        with open(PROC_STAT) as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    total = sum(fields[:8])  # guest time is counted in user time already
    return total - idle, total


def wait_until_quiet(
    busy_below: float = QUIET_BUSY, window_s: float = QUIET_WINDOW_S, max_s: float = QUIET_MAX_S
) -> float:
    """Wait until the CPUs are less than `busy_below` busy over `window_s`, at most
    `max_s`; the seconds waited. Where `/proc/stat` is missing, wait `max_s` / 10."""
    started = time.monotonic()
    before = _cpu_ticks()
    if before is None:
        time.sleep(max_s / 10)
        return time.monotonic() - started
    while time.monotonic() - started < max_s:
        time.sleep(window_s)
        after = _cpu_ticks()
        if after is None:  # /proc/stat went away: probe without waiting longer
            break
        busy, total = (a - b for a, b in zip(after, before, strict=True))
        if total > 0 and busy / total < busy_below:
            break
        before = after
    return time.monotonic() - started


def step_seconds(
    shape: ModelShape, ranks: int, rounds: int, alone: bool
) -> tuple[list[float], list[float]]:
    """Per round: the step's seconds in one process alone (when `alone`) and its mean
    seconds over `ranks` processes stepping at once.

    Raises:
        ValueError: fewer than 2 ranks.
        RuntimeError: a stepping process died, or a probe ran past `TIMEOUT_S`.
    """
    if ranks < 2:
        raise ValueError(f"probing the core share needs >= 2 ranks, got {ranks}")
    key = (shape, ranks)
    if key not in _STEPPERS:
        _STEPPERS[key] = _Steppers(shape, ranks)
    try:
        records = _STEPPERS[key].run(rounds, alone)
    except RuntimeError:
        del _STEPPERS[key]
        raise
    alone_s = [s for kind, _, s in sorted(records) if kind == "alone"]
    together = [
        statistics.fmean(s for kind, i, s in records if kind == "together" and i == r)
        for r in range(rounds)
    ]
    return alone_s, together


@dataclass(frozen=True)
class ShareProbe:
    """Probes the share of a core each of `ranks` processes gets (module docstring)."""

    shape: ModelShape
    ranks: int
    alone_s: float
    """The step's seconds in one process alone, at calibration."""

    @classmethod
    def calibrate(cls, shape: ModelShape, ranks: int) -> tuple[ShareProbe, float]:
        """The probe, with the step timed alone now, and the share probed meanwhile (the
        median over rounds of alone over together seconds), once the machine is quiet."""
        wait_until_quiet()
        alone, together = step_seconds(shape, ranks, CALIBRATION_ROUNDS, alone=True)
        share = statistics.median(a / t for a, t in zip(alone, together, strict=True))
        return cls(shape, ranks, statistics.median(alone)), min(1.0, share)

    def share(self) -> float:
        """Share of a core each rank gets now, at most 1 (once the machine is quiet)."""
        wait_until_quiet()
        _, together = step_seconds(self.shape, self.ranks, ROUNDS, alone=False)
        return min(1.0, self.alone_s / statistics.median(together))

    def readings(self, work: Callable[[], T]) -> tuple[T, float, float]:
        """`work()`'s result and the shares probed just before and just after it."""
        before = self.share()
        result = work()
        return result, before, self.share()

    def around(self, work: Callable[[], T], usual: float | None = None) -> tuple[T, float]:
        """`work()`'s result and the share each rank got around it (`run_share`)."""
        result, before, after = self.readings(work)
        return result, run_share(before, after, usual)


def run_share(before: float, after: float, usual: float | None) -> float:
    """The share a run got: with the `usual` share (the calibration's), the median of it
    and the probes just before and just after the run (module docstring); without, the
    mean of the two probes."""
    if usual is None:
        return (before + after) / 2
    return statistics.median([usual, before, after])
