"""A step of several micro-batches (`train.micro_batches`), simulated.

The trainer (`ray_zep.train.trainer.Trainer.train_step`) runs k micro-batches one after
another, each a whole forward and backward with its own plan and its own gradient
synchronisation (FSDP's per-block gathers and reduce-scatters, every micro-batch), sums
their gradients (`ray_zep.train.accumulate.GradientSum`) and clips and updates once. So
the step is the micro-batches' simulated steps one after another, less the optimizer
update that all but one of them do not run. Their fixed host work is counted every time
(each is a forward and backward of its own).

What it buys: each micro-batch holds at most L = `train.tokens_per_rank` tokens a rank,
so k micro-batches of L / k train as many tokens a step as one batch of L with 1 / k of
the activations at once, and may need no activation checkpointing where the one batch
needs some (`ray_zep.sim.bound` leaves recomputation out of the bound for that reason).
What it costs: the weights' collectives and the fixed work k times, one more copy of the
gradients (`ray_zep.parallel.memory`), and shorter ring pieces. `ray-zep bench scale`
plays both where a row recomputes (`--micro-batches`).

`split_batch` divides one batch's sequences into k parts of about equal tokens, longest
first, each to the part holding the fewest: what k batches a data actor draws at L / k
hold together, kept on the same sequences so that rows compare on the same batch.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np

from ray_zep.config import Config
from ray_zep.errors import ConfigError
from ray_zep.sim.step import StepResult

MICRO_BATCHES = (2, 3, 4)
"""Micro-batches a step `ray-zep plan --auto` tries where the fastest composition
recomputes activations (`ray_zep.sim.auto`). Every count, not only powers of two: on
`bench scale`'s 13b github batch at 16k tokens per GPU, 3 micro-batches of L / 3 train
2.7% (64 GPUs) and 2.9% (1,024) more tokens a second than the better of 2 and 4
(BENCHMARKS.md, forty-seventh series)."""


def micro_batched(config: Config, parts: int) -> Config:
    """`config` training each step as `parts` micro-batches of L / `parts` (rounded up)
    tokens a rank, `data.batch_fill` unchanged: the same tokens a step."""
    capacity = math.ceil(config.train.tokens_per_rank / parts)
    train = dataclasses.replace(config.train, tokens_per_rank=capacity, micro_batches=parts)
    return dataclasses.replace(config, train=train)


def split_batch(lengths: np.ndarray, parts: int) -> list[np.ndarray]:
    """`lengths` in `parts` micro-batches of about equal tokens (module docstring), each in
    the batch's order.

    Raises:
        ConfigError: `parts` < 1 or more parts than sequences.
    """
    lengths = np.asarray(lengths)
    if parts < 1 or parts > max(lengths.size, 1):
        raise ConfigError(f"micro-batches={parts}: between 1 and the batch's {lengths.size} "
                          "sequences")  # fmt: skip
    if parts == 1:
        return [lengths]
    owner = np.empty(lengths.size, dtype=np.int64)
    fullness = [(0, part) for part in range(parts)]  # a heap of (tokens, part)
    for i in np.argsort(-lengths, kind="stable").tolist():
        held, part = heapq.heappop(fullness)
        owner[i] = part
        heapq.heappush(fullness, (held + int(lengths[i]), part))
    return [lengths[owner == part] for part in range(parts)]


def micro_batched_step(steps: list[StepResult]) -> StepResult:
    """One step of the micro-batches whose own simulated steps are `steps`, in order (module
    docstring): their layers, heads, collectives, recomputation and fixed work add up, the
    optimizer update counts once. Its timelines are the first micro-batch's;
    `micro_steps` keeps all of them (`ray_zep.sim.bound.over_bound` sums their parts).

    Raises:
        ValueError: no steps.
    """
    if not steps:
        raise ValueError("micro_batched_step: no micro-batch steps")
    if len(steps) == 1:
        return steps[0]
    optimizer = max(s.optimizer_seconds for s in steps)
    first = steps[0]
    return dataclasses.replace(
        first,
        tokens=sum(s.tokens for s in steps),
        forward_layer_seconds=sum(s.forward_layer_seconds for s in steps),
        backward_layer_seconds=sum(s.backward_layer_seconds for s in steps),
        head_seconds=sum(s.head_seconds for s in steps),
        grad_sync_seconds=sum(s.grad_sync_seconds for s in steps),
        expert_seconds=sum(s.expert_seconds for s in steps),
        optimizer_seconds=optimizer,
        fixed_seconds=sum(s.fixed_seconds for s in steps),
        recompute_seconds=sum(s.recompute_seconds for s in steps),
        drift_seconds=sum(s.drift_seconds for s in steps),
        step_seconds=sum(s.step_seconds - s.optimizer_seconds for s in steps) + optimizer,
        micro_steps=tuple(steps),
    )


def micro_batched_steps(steps: list[StepResult], parts: int) -> list[StepResult]:
    """`micro_batched_step` of every `parts` consecutive `steps`: the micro-batches of
    one step after another's, each step's in order.

    Raises:
        ValueError: `steps` not whole steps of `parts` micro-batches.
    """
    if parts < 1 or len(steps) % parts:
        raise ValueError(f"micro_batched_steps: {len(steps)} steps are not steps of {parts}")
    return [micro_batched_step(steps[at : at + parts]) for at in range(0, len(steps), parts)]
