"""Megatron-LM's packing-aware dynamic context parallelism (`default_dynamic_cp`), simulated.

What Megatron-LM does (its `dev` branch at d48bd6b, 2026-08-21;
`--dynamic-context-parallel`, `--sequence-packing-scheduler default_dynamic_cp`,
`--max-seqlen-per-dp-cp-rank` = L):

- Padding. The THD datasets pad every sequence to a multiple of 2 x DP x CP (times TP
  with sequence parallelism) before scheduling, whatever CP size it later gets
  (`megatron/training/datasets/sft_dataset.py`, `SFTDataset._calculate_padding_divisor`,
  used by `varlen_dataset.py`, `VarlenDataset.__getitem__`); the scheduler sees the
  padded lengths (`data_schedule_utils.py`, `get_batch_and_global_seqlens` reads
  `padded_seq_len`). `dataset_padded` gives them.
- Groups. `parallel_state.create_dynamic_dp_cp_groups` builds, over the DP x CP ranks,
  aligned blocks of every power of two from `min_dynamic_context_parallel_size` (1) up
  to below DP x CP; `get_dynamic_data_context_parallel_groups` hands out those, or the
  whole DP x CP group for its size.
- Scheduling (`megatron/core/datasets/data_schedule.py`,
  `DefaultDynamicCPScheduler.get_groups_and_subsamples`): the whole global batch's
  lengths are gathered, sorted longest first, and cut into micro-batches by calling
  `data_schedule_utils.next_hdp_group_packing_aware` until none is left. One call
  makes one micro-batch that covers every DP x CP rank:
  - a sequence of s tokens needs at least `dcp_gpus_needed(s) = max(min_cp,
    2 ** ceil(log2(s / L)))` ranks; its workload on each of cp ranks is s^2 / cp;
  - the longest remaining sequence opens a group of its minimum size on ranks 0..;
    the cap of the micro-batch is that sequence's length x L x 1.05
    (`_DYNAMIC_CP_WORKLOAD_CAP_DELTA`), which the L budget below already implies (a
    rank's workload is its tokens times lengths no longer than that sequence's);
  - every other sequence, longest first, tries each power of two from its minimum
    up to DP x CP: joining an existing group of exactly that size whose ranks then hold
    at most L tokens (the packed sequences' s / cp summed), or opening a group of that
    size on the first free ranks. It takes the option with the smallest resulting
    busiest-rank workload over the micro-batch, if that is within the cap; ties go to
    the smaller CP size, then to joining, then to the older group. So a sequence joins
    the oldest group it fits without raising the busiest rank, opens a group on free
    ranks where every join would raise it, and takes a larger group than it needs only
    where that lowers the busiest rank. A sequence with no option waits for the next
    micro-batch;
  - `fill_empty_gpus_once` then doubles the first smallest group, shifting the groups
    after it, until no rank is idle (for a DP x CP that is not a power of two it
    falls back to one group of every rank; not modelled: this module needs a power of
    two, as the groups above do).
- Running (`DpBalancedScheduler.run`, shared by both schedulers): the sequences are
  gathered to their ranks inside the DP group (`reroute_samples_to_dcp_ranks`) and each
  rank's sequences of a micro-batch are packed into one THD sample with its
  `local_cp_size` (`build_packed_microbatches`). `megatron/training/training.py`
  (`train_step`) then runs the ordinary forward-backward schedule with the scheduled
  number of micro-batches: every rank runs the same count, forward then backward per
  micro-batch, the gradient reduction held until the last (`no_sync_func` in
  `schedules.forward_backward_no_pipelining`); the groups of a micro-batch run side by
  side, with no barrier between micro-batches beyond each group's own communication
  (`hybrid_cp_schedule.py`'s older `hybrid_context_parallel_forward_backward`, with a
  barrier per group, is no longer called).
- Attention. `get_batch_on_this_rank_for_sequence_packing` takes the group of
  `local_cp_size` (`parallel_state.get_dynamic_data_context_parallel_groups`) and
  slices the packed sample with TransformerEngine's `get_thd_partitioned_indices`
  (`get_cp_slice_for_thd`, `cp_partition_mode` zigzag by default): each sequence in
  2 x cp equal chunks, rank r holding chunks r and 2cp-1-r; attention is TE's CP with
  `--cp-comm-type` p2p by default (a ring over the group; one rank: no CP).
  `arguments.py` requires `--calculate-per-token-loss` and refuses CUDA graphs and
  Megatron-FSDP with dynamic CP.

What is modelled: `schedule_micro_batches` is `next_hdp_group_packing_aware` on the
padded lengths (same options, order, ties and fill); each micro-batch becomes one
`AttentionPlan` in which a group's sequences are one queue item (one ring per layer,
as TE runs a packed THD sample) zigzag-split evenly over its ranks, one-rank groups
whole (`ray_zep.sim.megatron_cp.wave_plan`); the step replays the micro-batches as
`ray_zep.sim.bytescale.simulate_schedule` does: a group starts once all its ranks are
done with the previous micro-batch and lasts its slowest rank's layers (forward and
backward) and LM head; the gradient sync, the optimizer and the fixed host work come
once. Pass `run.with_te_wire()` for TE's dK/dV dtype. Not counted (each favours the
baseline): the lengths' all-gather and the sequences' rerouting every step, and each
micro-batch's launch costs beyond its layers. A sharded weights mode gathers the
weights again per micro-batch, as torch FSDP2 would (Megatron-FSDP itself is refused).
"""

from __future__ import annotations

import numpy as np

from ray_zep.errors import ConfigError, PlacementError
from ray_zep.partition.plan import AttentionPlan
from ray_zep.sim.bytescale import MicroBatch, simulate_schedule
from ray_zep.sim.megatron_cp import (
    CPGroup,
    Wave,
    gpus_needed,
    rounds_longest_first,
    te_padded,
    wave_plan,
)
from ray_zep.sim.step import RunModel, StepResult

NAME = "megatron_dynamic_cp"
"""The simulator variant of this module."""
WORKLOAD_CAP_SLACK = 0.05
"""A micro-batch's busiest rank may take up to this fraction more workload than its
longest sequence x L (`_DYNAMIC_CP_WORKLOAD_CAP_DELTA`)."""


def dataset_padded(lengths: np.ndarray, world: int) -> np.ndarray:
    """Lengths as Megatron's THD datasets hand them to the dynamic-CP scheduler: each up
    to a multiple of 2 x the DP x CP ranks (`SFTDataset._calculate_padding_divisor`).

    Args:
        lengths: sequence lengths (tokens).
        world: the DP x CP ranks.

    Returns:
        int64 padded lengths, each >= its length and < length + 2 x `world`.
    """
    return te_padded(lengths, world)


def cp_needed(length: int, max_seqlen_per_rank: int, min_cp: int = 1) -> int:
    """The smallest CP size a sequence may take: the power of two of ranks holding at
    most `max_seqlen_per_rank` of its tokens each, at least `min_cp`
    (`dcp_gpus_needed`)."""
    return max(min_cp, gpus_needed(length, max_seqlen_per_rank))


def schedule_micro_batches(
    padded: np.ndarray, world: int, max_seqlen_per_rank: int, min_cp: int = 1
) -> list[Wave]:
    """The micro-batches `DefaultDynamicCPScheduler.get_groups_and_subsamples` makes of a
    global batch.

    Args:
        padded: the batch's sequence lengths as the scheduler sees them
            (`dataset_padded`).
        world: the DP x CP ranks.
        max_seqlen_per_rank: L, `max_seqlen_per_dp_cp_rank`.
        min_cp: `min_dynamic_context_parallel_size`.

    Returns:
        The micro-batches in execution order, each a list of groups of consecutive
        ranks covering every rank; every sequence is in exactly one group of one.

    Raises:
        ConfigError: `world` or `min_cp` is not a power of two, or `min_cp` > `world`.
        PlacementError: the batch is empty, or a sequence needs more ranks than there are.
    """
    _check_sizes(world, min_cp)
    lengths = [int(n) for n in np.asarray(padded, dtype=np.int64)]
    if not lengths:
        raise PlacementError(f"{NAME}: the batch has no sequences")
    needed = cp_needed(max(lengths), max_seqlen_per_rank, min_cp)
    return rounds_longest_first(
        lengths, needed, world, max_seqlen_per_rank, f"{NAME} (padded lengths)",
        lambda: _MicroBatchBuilder(lengths, world, max_seqlen_per_rank, min_cp),
    )  # fmt: skip


def _check_sizes(world: int, min_cp: int) -> None:
    if world < 1 or world & (world - 1):
        raise ConfigError(
            f"{NAME}: Megatron's dynamic CP groups are powers of two; the topology has "
            f"{world} ranks (set topology.nodes so the world is 2^k)"
        )
    if min_cp < 1 or min_cp & (min_cp - 1) or min_cp > world:
        raise ConfigError(
            f"{NAME}: min_dynamic_context_parallel_size={min_cp} must be a power of two "
            f"<= the {world} DP x CP ranks"
        )


class _MicroBatchBuilder:
    """One call of `next_hdp_group_packing_aware`. Groups are kept in creation order,
    which is also rank order (a new group takes the first free ranks); the ranks of a
    group carry equal workloads, so a group's load stands for its ranks'."""

    def __init__(self, lengths: list[int], world: int, limit: int, min_cp: int) -> None:
        self.lengths, self.world, self.limit, self.min_cp = lengths, world, limit, min_cp
        self.sizes = np.zeros(world, dtype=np.int64)
        self.loads = np.zeros(world)
        self.packed = np.zeros(world)
        """Tokens per rank of each group's packed sequences."""
        self.seqs: list[list[int]] = []

    @property
    def count(self) -> int:
        return len(self.seqs)

    def place(self, pending: list[int]) -> list[int]:
        """Place the longest of `pending` (sorted longest first), then every other one that
        has an option within the cap; the rest, in order."""
        first = pending[0]
        self._open(first, cp_needed(self.lengths[first], self.limit, self.min_cp))
        cap = float(self.lengths[first]) * float(self.limit) * (1.0 + WORKLOAD_CAP_SLACK)
        leftover = []
        for seq in pending[1:]:
            choice = self._best(self.lengths[seq], cap)
            if choice is None:
                leftover.append(seq)
            elif choice[0] is None:
                self._open(seq, choice[1])
            else:
                self._join(seq, choice[0])
        return leftover

    def _best(self, length: int, cap: float) -> tuple[int | None, int] | None:
        """(group to join or None for a new one, CP size): the option with the smallest
        busiest rank within `cap`, the first found on ties (smaller CP size, joining before
        opening, older group first); None when no option is within the cap."""
        n = self.count
        top = float(self.loads[:n].max())
        free = self.world - int(self.sizes[:n].sum())
        best: tuple[float, int | None, int] | None = None
        cp = cp_needed(length, self.limit, self.min_cp)
        while cp <= self.world:
            cost = (length * length) / cp
            room = (self.sizes[:n] == cp) & (self.packed[:n] + length / cp <= self.limit)
            groups = np.flatnonzero(room)
            if groups.size:
                # Every rank of a group has its load, so the busiest rank after joining
                # is the larger of today's busiest and the group's load plus the cost.
                projected = np.maximum(top, self.loads[groups] + cost)
                k = int(np.argmin(projected))
                if projected[k] <= cap and (best is None or projected[k] < best[0]):
                    best = (float(projected[k]), int(groups[k]), cp)
            projected_new = max(top, cost)
            if free >= cp and projected_new <= cap and (best is None or projected_new < best[0]):
                best = (projected_new, None, cp)
            cp *= 2
        return None if best is None else best[1:]

    def _open(self, seq: int, cp: int) -> None:
        n, length = self.count, self.lengths[seq]
        self.sizes[n] = cp
        self.loads[n] = (length * length) / cp
        self.packed[n] = length / cp
        self.seqs.append([seq])

    def _join(self, seq: int, group: int) -> None:
        cp, length = int(self.sizes[group]), self.lengths[seq]
        self.loads[group] += (length * length) / cp
        self.packed[group] += length / cp
        self.seqs[group].append(seq)

    def finish(self) -> Wave:
        """`fill_empty_gpus_once` until no rank is idle: double the first smallest group,
        shifting the later ones right (with a power-of-two world the first always fits)."""
        sizes = self.sizes[: self.count].tolist()
        while sum(sizes) < self.world:
            smallest = min(sizes)
            sizes[sizes.index(smallest)] = min(2 * smallest, self.world)
        starts = np.cumsum([0, *sizes[:-1]]).tolist()
        return [
            CPGroup(tuple(range(start, start + size)), tuple(seqs))
            for start, size, seqs in zip(starts, sizes, self.seqs, strict=True)
        ]


def dynamic_cp_plans(
    lengths: np.ndarray, run: RunModel
) -> tuple[list[MicroBatch], list[AttentionPlan]]:
    """The schedule of a batch under L = `run.config.train.tokens_per_rank` and one plan
    per micro-batch (plan sequences are the padded lengths, in the order of its groups).

    Returns:
        (each group of each micro-batch as a `MicroBatch` whose `round` is the micro-batch,
        in execution order; the micro-batches' plans), as
        `ray_zep.sim.bytescale.simulate_schedule` takes them.

    Raises:
        ConfigError, PlacementError: as `schedule_micro_batches`.
    """
    topology = run.hardware.topology
    limit = run.config.train.tokens_per_rank
    padded = dataset_padded(np.asarray(lengths, dtype=np.int64), topology.world_size)
    waves = schedule_micro_batches(padded, topology.world_size, limit)
    batches = [MicroBatch(g.seqs, g.ranks, k) for k, wave in enumerate(waves) for g in wave]
    plans = [wave_plan(padded, wave, topology, limit)[0] for wave in waves]
    return batches, plans


def rank_micro_batches(batches: list[MicroBatch], world: int) -> np.ndarray:
    """How many micro-batches each rank runs (every rank the same under this schedule)."""
    counts = np.zeros(world, dtype=np.int64)
    for batch in batches:
        counts[list(batch.ranks)] += 1
    return counts


def simulate_dynamic_cp(lengths: np.ndarray, run: RunModel) -> StepResult:
    """One step of Megatron-LM's dynamic CP on a batch (module docstring), with
    L = `run.config.train.tokens_per_rank` and `run`'s weights mode; pass
    `run.with_te_wire()` for TE's dK/dV dtype.

    Returns:
        The step: the micro-batches replayed group by group, the gradient sync, optimizer
        and fixed work once; the first micro-batch's timelines; the real tokens.

    Raises:
        ConfigError, PlacementError: as `schedule_micro_batches`.
    """
    return simulate_schedule(np.asarray(lengths), *dynamic_cp_plans(lengths, run), run)
