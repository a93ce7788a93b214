"""Megatron-Core's hybrid DP x CP (its balanced CP scheduler, in waves) and TransformerEngine's CP
padding, simulated (Megatron-LM's newer dynamic CP is `ray_zep.sim.megatron_dynamic_cp`).

Megatron-Core's `hybrid_context_parallel` (with `max_seqlen_per_dp_cp_rank` = L)
gives each sequence of a global batch its own context-parallel group inside the
DP x CP ranks. `BalancedCPScheduler` (Megatron-LM
`megatron/core/pipeline_parallel/hybrid_cp_schedule.py`) does the placement:

- a sequence of s tokens needs `gpus_needed(s) = 2 ** ceil(log2(s / L))` ranks (at
  least 1), the power of two whose process groups `parallel_state.
  create_hybrid_dp_cp_groups` builds; its workload is `s ** 2 / cp`
  (`get_total_workload`);
- `get_groups_and_subsamples` sorts the sequences longest first and cuts them into
  groups (here: waves) with `next_hdp_group`: buckets of roughly equal work, one
  per distinct CP size (`make_buckets_equal`); each sequence goes to a fresh group
  of contiguous free ranks when enough are free, else to the least-loaded group of
  its size; once smaller CP sizes are being placed the wave closes as soon as every
  rank's load is within 5% of the largest (`delta`); `trim_overload` then returns
  the last sequences of the most loaded group while that narrows the spread, and
  `fill_empty_gpus` doubles the smallest group (shifting the ones after it) until
  no rank is idle; the groups are then laid out largest first, on the aligned ranks
  Megatron's process groups of each size have;
- `hybrid_context_parallel_forward_backward` runs the waves one after another
  with a barrier after each; inside a wave every rank runs its sequences one by one,
  each sequence's attention being TransformerEngine's ring CP over its group
  (`megatron/core/utils.py`, `_get_batch_on_this_cp_rank_per_sequence_balancing`:
  2 x cp equal zigzag chunks) and a group of one rank being plain DP.

A wave becomes one `AttentionPlan`: each group's sequences are one queue item on
the group's ranks, zigzag-split evenly after padding to a multiple of 2 x cp (TE
needs equal chunks); sequences on one rank stay whole. Played with
`ray_zep.sim.step.simulate_plan`, every wave pays its layers (forward + backward)
and its LM head; the weights' gradient sync, the optimizer and the fixed host work
are paid once per step (`no_sync_func` holds the gradient reduction until the last
wave); a sharded weights mode gathers the weights again in every wave, as FSDP does
per micro-batch. Two simplifications favour the baseline: a group's sequences share one
ring per layer instead of one ring each, and each sequence's per-micro-batch
launch costs are not counted.

TransformerEngine's THD format needs every sequence of a CP group padded to a
multiple of 2 x cp (`pad_thd_sequences_for_cp`, `get_batch_on_this_cp_rank` in
`transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py`):
`te_padded` gives those lengths. Padded tokens cost compute and bytes; throughput
counts the real tokens.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

import numpy as np

from ray_zep.errors import ConfigError, PlacementError
from ray_zep.parallel.axes import Placement
from ray_zep.partition.plan import AttentionPlan, SeqPlacement, even_bounds, local_placement
from ray_zep.sim.step import RunModel, StepResult, simulate_plan
from ray_zep.topology import Topology

BALANCE_SLACK = 0.05
"""A wave closes once every rank's load is within this fraction of the largest
(`next_hdp_group`'s `delta`)."""
BUCKET_SLACK = 1.1
"""A bucket closes when the next sequence would take it past this multiple of its
share of the work (`make_buckets_equal`)."""
NAME = "megatron_hybrid_cp"
"""The simulator variant of this module."""


def te_padded(lengths: np.ndarray, cp: int) -> np.ndarray:
    """Lengths padded as TransformerEngine's THD CP needs them: each up to a multiple of
    2 x `cp` (no padding for `cp` = 1, where nothing is split).

    Args:
        lengths: sequence lengths (tokens).
        cp: ranks of the CP group the sequences are split over.

    Returns:
        int64 padded lengths, each >= its length and < length + 2 x cp.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if cp <= 1:
        return lengths
    factor = 2 * cp
    return -(-lengths // factor) * factor


def gpus_needed(length: int, max_seqlen_per_rank: int) -> int:
    """The CP size of a sequence: the smallest power of two of ranks holding at most
    `max_seqlen_per_rank` of its tokens each (`BalancedCPScheduler.gpus_needed`)."""
    ranks = 1
    while ranks * max_seqlen_per_rank < length:
        ranks *= 2
    return ranks


@dataclass(frozen=True)
class CPGroup:
    """Contiguous ranks that run the same sequences, one after another.

    Attributes:
        ranks: the group (a power of two of consecutive ranks).
        seqs: indices into the batch of the sequences it runs, in order.
    """

    ranks: tuple[int, ...]
    seqs: tuple[int, ...]


Wave = list[CPGroup]
"""Groups that run side by side between two barriers; they cover every rank."""


def schedule_waves(lengths: np.ndarray, world: int, max_seqlen_per_rank: int) -> list[Wave]:
    """The waves `BalancedCPScheduler.get_groups_and_subsamples` makes of a batch.

    Args:
        lengths: the batch's sequence lengths.
        world: the DP x CP ranks.
        max_seqlen_per_rank: L, Megatron's `max_seqlen_per_dp_cp_rank`.

    Returns:
        The waves in execution order; every sequence is in exactly one group of one wave.

    Raises:
        ConfigError: `world` is not a power of two (`create_hybrid_dp_cp_groups` builds
            groups of every power of two below the world and the world itself, so the
            schedule's power-of-two sizes would leave ranks without a group).
        PlacementError: a sequence needs more ranks than there are.
    """
    if world < 1 or world & (world - 1):
        raise ConfigError(
            f"{NAME}: Megatron-Core's hybrid DP x CP groups are powers of two; "
            f"the topology has {world} ranks (set topology.nodes so the world is 2^k)"
        )
    lengths = [int(n) for n in np.asarray(lengths, dtype=np.int64)]
    needed = gpus_needed(max(lengths, default=0), max_seqlen_per_rank)
    return rounds_longest_first(
        lengths, needed, world, max_seqlen_per_rank, NAME,
        lambda: _WaveBuilder(lengths, world, max_seqlen_per_rank),
    )  # fmt: skip


def rounds_longest_first(lengths: list[int], needed: int, world: int, limit: int, name: str,
                         builder) -> list[Wave]:  # fmt: skip
    """The rounds (waves, micro-batches) a scheduler makes: the sequences sorted once,
    longest first, each round a fresh `builder()` placing what it can of the rest (its
    leftovers keep their order; a builder may put the ones it trims last).

    Raises:
        PlacementError: the longest sequence needs `needed` ranks, more than `world`.
    """
    if needed > world:
        raise PlacementError(
            f"{name}: a sequence of {max(lengths)} tokens needs more than {world} ranks x "
            f"train.tokens_per_rank={limit}"
        )
    pending = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rounds = []
    while pending:
        one = builder()
        pending = one.place(pending)
        rounds.append(one.finish())
    return rounds


class _WaveBuilder:
    """One call of `next_hdp_group`: groups in creation order, laid out from rank 0."""

    def __init__(self, lengths: list[int], world: int, max_seqlen_per_rank: int) -> None:
        self.lengths = lengths
        self.world = world
        self.limit = max_seqlen_per_rank
        self.sizes: list[int] = []
        self.seqs: list[list[int]] = []
        self.load = np.zeros(world)

    def needed(self, seq: int) -> int:
        return gpus_needed(self.lengths[seq], self.limit)

    def work(self, seq: int) -> float:
        """`get_total_workload` with the sequence's own CP size."""
        return float(self.lengths[seq]) ** 2 / self.needed(seq)

    def group_ranks(self, group: int) -> range:
        start = sum(self.sizes[:group])
        return range(start, start + self.sizes[group])

    def place(self, pending: list[int]) -> list[int]:
        """Place sequences from `pending` until the wave is balanced or full; the rest."""
        buckets = self._buckets(pending)
        first_size, check_balance = None, False
        while buckets:
            picked = self._pick(buckets)
            if picked is None:
                break
            bucket, seq = picked
            size = self.needed(seq)
            first_size = first_size or size
            self._assign(seq, size)
            buckets[bucket].popleft()
            while buckets and not buckets[0]:
                buckets.pop(0)
            check_balance = check_balance or size < first_size
            top = self.load.max()
            if check_balance and buckets and top - self.load.min() <= BALANCE_SLACK * top:
                break
        leftover = [seq for bucket in buckets for seq in bucket]
        return leftover + self._trim()

    def _buckets(self, pending: list[int]) -> list[deque]:
        """`make_buckets_equal`: one bucket per distinct CP size, of about equal work."""
        k = len({self.needed(s) for s in pending})
        target = sum(self.work(s) for s in pending) / k
        buckets, current, current_work = [], [], 0.0
        for i, seq in enumerate(pending):
            # Megatron reserves sequences for the buckets still to come with
            # `remaining_k - len(buckets)`, both of which move with every closed bucket.
            reserve = k - 2 * len(buckets)
            over = current_work + self.work(seq) > BUCKET_SLACK * target
            if current and (over or len(pending) - i <= reserve):
                buckets.append(deque(current))
                current, current_work = [], 0.0
            current.append(seq)
            current_work += self.work(seq)
        if current:
            buckets.append(deque(current))
        return buckets

    def _pick(self, buckets: list[deque]) -> tuple[int, int] | None:
        """The first bucket head that has a group of its size or enough free ranks."""
        free = self.world - sum(self.sizes)
        for index, bucket in enumerate(buckets):
            if bucket and (self.needed(bucket[0]) in self.sizes or free >= self.needed(bucket[0])):
                return index, bucket[0]
        return None

    def _assign(self, seq: int, size: int) -> None:
        """A fresh group on the first free ranks when enough are free (their load, 0, is
        below any group's); else the group of that size whose busiest rank is least loaded."""
        if self.world - sum(self.sizes) >= size:
            self.sizes.append(size)
            self.seqs.append([])
            group = len(self.sizes) - 1
        else:
            same = [g for g, s in enumerate(self.sizes) if s == size]
            group = min(same, key=lambda g: self.load[self.group_ranks(g)].max())
        self.seqs[group].append(seq)
        self.load[self.group_ranks(group)] += self.work(seq)

    def _trim(self) -> list[int]:
        """`trim_overload`: drop the most loaded group's last sequence while that narrows the
        spread of the loads (never a group's only one, never while a rank is idle)."""
        dropped = []
        while True:
            top, bottom = self.load.max(), self.load.min()
            if top - bottom <= BALANCE_SLACK * top or bottom == 0:
                break
            rank = int(np.argmax(self.load))
            group = next(g for g in range(len(self.sizes)) if rank in self.group_ranks(g))
            if len(self.seqs[group]) <= 1:
                break
            seq = self.seqs[group][-1]
            projected = self.load.copy()
            projected[self.group_ranks(group)] -= self.work(seq)
            if projected.max() - projected.min() >= top - bottom:
                break
            self.seqs[group].pop()
            self.load = projected
            dropped.append(seq)
        return dropped

    def finish(self) -> Wave:
        """`fill_empty_gpus`: double the first smallest group until the groups cover every
        rank; then the groups laid out largest first.

        Megatron lays them out in creation order, but its process groups of each size
        are aligned (`create_hybrid_dp_cp_groups`: a group of k ranks starts at a
        multiple of k), and a wave whose leftovers put a small group before a larger one
        would ask for a group that does not exist. Largest first, every group starts at
        a multiple of its size (powers of two summing to the world)."""
        while sum(self.sizes) < self.world:
            smallest = min(self.sizes)
            group = self.sizes.index(smallest)
            self.sizes[group] = min(2 * smallest, self.world)
        order = sorted(range(len(self.sizes)), key=lambda g: -self.sizes[g])
        groups, start = [], 0
        for g in order:
            groups.append(CPGroup(tuple(range(start, start + self.sizes[g])), tuple(self.seqs[g])))
            start += self.sizes[g]
        return groups


def wave_plan(
    lengths: np.ndarray, wave: Wave, topology: Topology, tokens_per_rank: int
) -> tuple[AttentionPlan, np.ndarray]:
    """A wave as one plan: each group's sequences zigzag-split evenly over its ranks after
    TE's padding, a one-rank group's sequences whole. The plan's sequence i is batch
    sequence `order[i]`; its capacity is L or the wave's fullest rank, whichever is more
    (a rank runs its sequences one after another, never all at once).

    Returns:
        (the plan, order: the batch index of each of its sequences).
    """
    placements, order = [], []
    for group in wave:
        cp = len(group.ranks)
        padded = te_padded(np.asarray([lengths[s] for s in group.seqs]), cp)
        for seq, n in zip(group.seqs, padded.tolist(), strict=True):
            index = len(placements)
            if cp == 1:
                placements.append(local_placement(index, n, group.ranks[0]))
            else:
                placements.append(SeqPlacement(index, n, group.ranks, even_bounds(n, cp)))
            order.append(seq)
    plan = AttentionPlan(Placement.TE_CP, topology, tokens_per_rank, tuple(placements))
    plan.tokens_per_rank = max(tokens_per_rank, int(plan.rank_tokens().max(initial=0)))
    plan.validate()
    return plan, np.asarray(order, dtype=np.int64)


def hybrid_cp_wave_plans(lengths: np.ndarray, run: RunModel) -> list[AttentionPlan]:
    """The plan of each wave Megatron-Core's hybrid DP x CP runs a batch in (L =
    `run.config.train.tokens_per_rank`).

    Raises:
        ConfigError, PlacementError: as `schedule_waves`, or an empty batch.
    """
    topology = run.hardware.topology
    limit = run.config.train.tokens_per_rank
    waves = schedule_waves(lengths, topology.world_size, limit)
    if not waves:
        raise PlacementError(f"{NAME}: the batch has no sequences")
    return [wave_plan(lengths, w, topology, limit)[0] for w in waves]


def simulate_hybrid_cp(
    lengths: np.ndarray, run: RunModel, waves: list[AttentionPlan] | None = None
) -> StepResult:
    """One step of Megatron-Core's hybrid DP x CP on a batch (module docstring), with
    L = `run.config.train.tokens_per_rank` and `run`'s weights mode; pass
    `run.with_te_wire()` for TE's dK/dV dtype, and the batch's `hybrid_cp_wave_plans`
    where they are at hand.

    Returns:
        The step: per-layer and head seconds summed over the waves, the gradient sync,
        optimizer and fixed work once; the first wave's timelines; the real tokens.

    Raises:
        ConfigError, PlacementError: as `schedule_waves`, or an empty batch.
    """
    waves = waves if waves is not None else hybrid_cp_wave_plans(lengths, run)
    steps = [simulate_plan(plan, run) for plan in waves]
    first = steps[0]
    n_layers = run.shape.n_layers
    forward = sum(s.forward_layer_seconds for s in steps)
    backward = sum(s.backward_layer_seconds for s in steps)
    head = sum(s.head_seconds for s in steps)
    experts = sum(s.expert_seconds for s in steps)
    recompute = sum(s.recompute_seconds for s in steps)
    once = first.grad_sync_seconds + first.optimizer_seconds + first.fixed_seconds
    return dataclasses.replace(
        first,
        tokens=int(np.asarray(lengths, dtype=np.int64).sum()),
        forward_layer_seconds=forward,
        backward_layer_seconds=backward,
        head_seconds=head,
        expert_seconds=experts,
        recompute_seconds=recompute,
        step_seconds=n_layers * (forward + backward) + head + experts + recompute + once,
    )
