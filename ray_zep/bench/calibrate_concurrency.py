"""How fast a rank's compute runs while every rank of a CPU virtual cluster computes.

The calibration times kernels in one process alone and scales them by the share of a
core each rank gets (`ray_zep.bench.core_share`). That probe runs a Python loop, and
a Python loop shares a core better than the model's kernels do: on a 2-core VM whose
vCPUs share their floating-point units and caches, 4 processes running a whole-sequence
training step got 0.69 of the probed share (the step in 4 bare gloo processes took
1.45x what kernels timed alone, scaled by the probe, give), where messages and the
attention engine's ring steps, measured among the ranks, already carry it.

So the model's own training step (forward and backward of every layer, with the
kernel training selects for its attention, on packed sequences) is timed in one
process alone and in `ranks` processes at once; with the share probed around it,
`compute_share` = (alone seconds / concurrent seconds) / probed share is the factor
the rates measured alone take inside a cluster of computing ranks
(`Calibration.compute_share`). Rounds alternate alone and together; the factor is
their median.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from ray_zep.model.shapes import ModelShape

TOKENS = 1024
"""Tokens of the timed step (packed)."""
SEQUENCE = 256
"""Length of each packed sequence."""
ROUNDS = 5
STEPS = 3
"""Steps timed per process and round."""


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


def _worker(rank: int, shape: ModelShape, barrier, result) -> None:
    torch.set_num_threads(1)
    step = _step_fn(shape)
    for _ in range(ROUNDS):
        barrier.wait()
        if rank == 0:
            result.append(("alone", _timed(step)))
        barrier.wait()
        result.append(("together", _timed(step)))
        barrier.wait()


def concurrent_ratio(shape: ModelShape, ranks: int) -> float:
    """Median over rounds of (a step's seconds in one process alone) / (its mean seconds
    in `ranks` processes at once).

    Raises:
        ValueError: fewer than 2 ranks.
    """
    import torch.multiprocessing as mp

    if ranks < 2:
        raise ValueError(f"measuring concurrent compute needs >= 2 ranks, got {ranks}")
    with mp.Manager() as manager:
        barrier, result = manager.Barrier(ranks), manager.list()
        mp.spawn(_worker, args=(shape, barrier, result), nprocs=ranks, join=True)
        records = list(result)
    alone = [s for kind, s in records if kind == "alone"]
    together = [s for kind, s in records if kind == "together"]
    ratios = [
        a / statistics.fmean(together[i * ranks : (i + 1) * ranks]) for i, a in enumerate(alone)
    ]
    return statistics.median(ratios)


def compute_share(ratio: float, probed_share: float) -> float:
    """The factor on the probed share that compute measured alone takes among the ranks
    (module docstring), in (0, 1.5]."""
    if ratio <= 0 or probed_share <= 0:
        raise ValueError(f"ratio {ratio} and probed share {probed_share} must be > 0")
    return min(1.5, ratio / probed_share)
