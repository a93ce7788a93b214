"""ByteScale's hybrid data parallelism (HDP) with its data-aware balance, simulated.

ByteScale (Ge et al., "ByteScale: Efficient Scaling of LLM Training with a 2048K
Context Length on More Than 12,000 GPUs", arXiv 2502.21231, sections 4-5) merges
data and context parallelism into one set of ranks, each holding at most C tokens
of a micro-batch (here C = L, `train.tokens_per_rank`):

- a sequence longer than C is split over ceil(s / C) ranks (any count, not a power
  of two), a ring over P2P sends; shorter ones are packed into micro-batches of at
  most C tokens (best fit, longest first) that one rank runs alone;
- ranks run different numbers of micro-batches within a step (gradient accumulation
  with no barrier between them), so the balance is in time, not in tokens: the
  scheduler estimates each micro-batch's time with a fitted cost T(s) = a s^2 + b s + c
  per sequence and hands the next micro-batch, costliest first, to the ranks that
  are the furthest behind; a split sequence's ranks start it together;
- the gradient all-reduce, the optimizer and the fixed host work come once per step.

No public implementation was found, so this follows the paper's description. Two
choices favour the baseline: its cost estimate is this simulator's own work model
(`ray_zep.partition.work.WorkModel`: the exact per-length rates, not a fit), and its
rings send dK/dV in the activation dtype (pass `run.with_te_wire()`, as
`ray-zep simulate` does), which its cost estimate counts too. Its rings are even zigzag
splits with no padding.

Playing it: micro-batches that hold disjoint ranks form a round (a rank's k-th
micro-batch is in round k or later); each round is one `AttentionPlan`, played with
`ray_zep.sim.step.simulate_plan` so that rings in the same round share links. A
micro-batch lasts its ranks' slowest forward and backward layer times the layers,
plus its LM head; the step replays the schedule with those durations, each rank
running its micro-batches in order and a ring's ranks starting together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ray_zep.errors import PlacementError
from ray_zep.parallel.axes import Placement
from ray_zep.partition.plan import AttentionPlan, SeqPlacement, even_bounds, local_placement
from ray_zep.partition.work import WorkModel
from ray_zep.sim.drift import rank_ends
from ray_zep.sim.step import RunModel, StepResult, head_seconds, simulate_plan

NAME = "bytescale_hdp"
"""The simulator variant of this module."""


@dataclass(frozen=True)
class MicroBatch:
    """Work one set of ranks runs together.

    Attributes:
        seqs: batch indices of its sequences (one when split over several ranks).
        ranks: the ranks that run it (ascending).
        round: the plan it is played in.
    """

    seqs: tuple[int, ...]
    ranks: tuple[int, ...]
    round: int


def micro_batches(lengths: np.ndarray, capacity: int) -> list[tuple[tuple[int, ...], int]]:
    """ByteScale's micro-batches of a batch, unplaced: (sequences, ranks it needs).

    A sequence longer than `capacity` needs ceil(s / capacity) ranks; the others are
    packed best fit, longest first, into bins of at most `capacity` tokens.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    long = order[lengths[order] > capacity]
    out = [((int(s),), -(-int(lengths[s]) // capacity)) for s in long]
    bins: list[list[int]] = []
    room = np.zeros(0, dtype=np.int64)
    for seq in order[lengths[order] <= capacity].tolist():
        n = int(lengths[seq])
        fits = np.flatnonzero(room >= n)
        if fits.size:
            best = int(fits[np.argmin(room[fits])])
            bins[best].append(seq)
            room[best] -= n
        else:
            bins.append([seq])
            room = np.append(room, capacity - n)
    return out + [(tuple(b), 1) for b in bins]


def estimated_seconds(
    units: list[tuple[tuple[int, ...], int]], lengths: np.ndarray, model: WorkModel
) -> np.ndarray:
    """Each micro-batch's modelled seconds on one of its ranks (the scheduler's T): a
    packed one's sequences whole, a split sequence's member of its ring."""
    width = np.asarray([ranks for _, ranks in units], dtype=np.int64)
    whole = model.whole_seconds(lengths)
    out = np.asarray([whole[list(seqs)].sum() for seqs, _ in units])
    ring = np.flatnonzero(width > 1)
    firsts = lengths[[units[i][0][0] for i in ring.tolist()]]
    out[ring] = model.alone_ring_seconds(firsts, width[ring])
    return out


def schedule(lengths: np.ndarray, run: RunModel) -> list[MicroBatch]:
    """ByteScale's data-aware balance of a batch (module docstring), in the order the
    micro-batches were handed out.

    Raises:
        PlacementError: a sequence needs more ranks than there are, or the batch is empty.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    topology = run.hardware.topology
    world, capacity = topology.world_size, run.config.train.tokens_per_rank
    if lengths.size == 0:
        raise PlacementError(f"{NAME}: the batch has no sequences")
    units = micro_batches(lengths, capacity)
    widest = max(ranks for _, ranks in units)
    if widest > world:
        raise PlacementError(
            f"{NAME}: a sequence of {int(lengths.max())} tokens needs {widest} ranks of "
            f"train.tokens_per_rank={capacity}; the topology has {world}"
        )
    model = WorkModel.create(run.shape, topology, run.hardware.rates, dkv_wire=run.dkv_wire)
    seconds = estimated_seconds(units, lengths, model)
    load = np.zeros(world)
    rounds = np.zeros(world, dtype=np.int64)
    out = []
    for i in np.argsort(-seconds, kind="stable").tolist():
        seqs, width = units[i]
        ranks = np.sort(np.argsort(load, kind="stable")[:width])
        load[ranks] = load[ranks].max() + seconds[i]
        index = int(rounds[ranks].max())
        rounds[ranks] = index + 1
        out.append(MicroBatch(seqs, tuple(ranks.tolist()), index))
    return out


def round_plans(
    lengths: np.ndarray, batches: list[MicroBatch], run: RunModel
) -> list[AttentionPlan]:
    """One plan per round: a split sequence even-zigzag over its ranks, a packed
    micro-batch's sequences whole on its rank. Plan sequence indices follow the order
    of `batches` within the round."""
    topology = run.hardware.topology
    capacity = run.config.train.tokens_per_rank
    count = max(b.round for b in batches) + 1
    placements: list[list[SeqPlacement]] = [[] for _ in range(count)]
    for batch in batches:
        into = placements[batch.round]
        for seq in batch.seqs:
            n = int(lengths[seq])
            if len(batch.ranks) == 1:
                into.append(local_placement(len(into), n, batch.ranks[0]))
            else:
                bounds = even_bounds(n, len(batch.ranks))
                into.append(SeqPlacement(len(into), n, batch.ranks, bounds))
    plans = []
    for group in placements:
        plan = AttentionPlan(Placement.HYBRID_DP, topology, capacity, tuple(group))
        plan.tokens_per_rank = max(capacity, int(plan.rank_tokens().max(initial=0)))
        plan.validate()
        plans.append(plan)
    return plans


def bytescale_plans(
    lengths: np.ndarray, run: RunModel
) -> tuple[list[MicroBatch], list[AttentionPlan]]:
    """The schedule of a batch and its rounds' plans (what the planner hands the ranks).

    Raises:
        PlacementError: as `schedule`.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    batches = schedule(lengths, run)
    return batches, round_plans(lengths, batches, run)


def simulate_bytescale(lengths: np.ndarray, run: RunModel) -> StepResult:
    """One step of ByteScale's HDP on a batch (module docstring).

    Raises:
        PlacementError: as `schedule`.
    """
    return simulate_schedule(lengths, *bytescale_plans(lengths, run), run)


def simulate_schedule(
    lengths: np.ndarray, batches: list[MicroBatch], plans: list[AttentionPlan], run: RunModel
) -> StepResult:
    """Play `bytescale_plans`' rounds and replay the schedule with their durations.

    Returns:
        The step; its layer and head seconds are the rounds' sums scaled to the
        replayed schedule's length; the first round's timelines; the real tokens.
    """
    steps = [simulate_plan(plan, run) for plan in plans]
    world, layers = run.hardware.topology.world_size, run.shape.n_layers
    layer_ends, heads = [], []
    for plan, step in zip(plans, steps, strict=True):
        forward, backward = rank_ends(step.forward, world), rank_ends(step.backward, world)
        extra = step.expert_seconds + step.recompute_seconds
        layer_ends.append(layers * (forward + backward) + extra)
        heads.append(head_seconds(plan.rank_tokens(), run.shape, run.hardware.rates))
    finish = np.zeros(world)
    for batch in batches:
        ranks = list(batch.ranks)
        took = layer_ends[batch.round][ranks].max() + heads[batch.round][ranks].max()
        finish[ranks] = finish[ranks].max() + took
    makespan = float(finish.max())
    forward = sum(s.forward_layer_seconds for s in steps)
    backward = sum(s.backward_layer_seconds for s in steps)
    head = sum(s.head_seconds for s in steps)
    experts = sum(s.expert_seconds for s in steps)
    recompute = sum(s.recompute_seconds for s in steps)
    played = layers * (forward + backward) + head + experts + recompute
    scale = makespan / played if played > 0 else 0.0
    first = steps[0]
    once = first.grad_sync_seconds + first.optimizer_seconds + first.fixed_seconds
    return dataclasses.replace(
        first,
        tokens=int(np.asarray(lengths).sum()),
        forward_layer_seconds=forward * scale,
        backward_layer_seconds=backward * scale,
        head_seconds=head * scale,
        expert_seconds=experts * scale,
        recompute_seconds=recompute * scale,
        step_seconds=makespan + once,
    )
