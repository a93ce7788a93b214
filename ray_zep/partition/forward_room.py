"""The kept level's whole sequences dealt again with each rank's forward counted too
(`ray_zep.partition.balance`).

A level bounds each rank's work, forward and backward together, and the scan keeps the
level whose busiest rank is lowest. A step, though, waits for the forward's slowest rank
and then for the backward's, so a rank within the level can still set the forward: a
ring member whose hops its forward steps do not hide (the forward computes a third of
the attention the backward does, over the same K/V), or a rank of short whole sequences,
whose matmuls' forward is a larger share of their work than a long sequence's attention
is. The fill tops up the ranks the rings leave under the level with whole sequences; on
a forward-heavy ring member each one adds to the forward that sets the step.

So once the scan has kept a level, that level is placed again with its fill keeping each
rank's forward within the level's share of it too: the batch's forward over its work,
both as the work model costs them (ring members at their rings' forward steps,
`WorkModel.ring_forward_seconds` and `usp_group_forward_seconds`; whole sequences at
`whole_forward_seconds`). Whole sequences' forward share varies little from one to the
next, so a rank's room in forward, in whole sequences' work, is its forward room over
that share; where that is less than its room under the level, the fill sees the rank
that much fuller (`forward_offsets`), an offset that stays right as the rank takes whole
sequences, since both rooms shrink by each one's work. The second placement is kept
where its busiest rank is no busier and its forward's busiest rank plus its backward's
(`phase_seconds`) is lower: the level's objective first, the phases as the tie-break.

On `bench scale`'s grid at 4k tokens per GPU (BENCHMARKS.md, sixty-seventh series) the
second placement was kept on the prolong64k rows at 256-4,096 GPUs, whose batches are
nearly all long documents that leave few short ones to fill with, and on 7b arxiv at
4,096 GPUs: those steps 0.3-2.3% shorter, no row slower. Placed so at every level of the
scan instead, the arxiv rows' levels rose to fit the whole sequences the forward turned
away (13b arxiv at 256 GPUs 5.8% slower); kept on the phases alone, whatever its busiest
rank, 7b arxiv at 64 GPUs stepped 2.4% slower (the work model's forward is not the
simulator's there).
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition.level_fill import Placed
from ray_zep.partition.work import RingParts, WorkModel
from ray_zep.topology import LinkKind


def forward_offsets(
    placed: Placed,
    lengths: np.ndarray,
    work: np.ndarray,
    wholes: np.ndarray,
    level: float,
    model: WorkModel,
) -> np.ndarray | None:
    """How much fuller than its work the fill should see each rank of `placed` (its rings
    placed, `wholes` not yet), so that whole sequences keep its forward within the
    level's share (module docstring); None where that binds on no rank."""
    if not placed.groups or wholes.size == 0:
        return None
    whole_work = float(work[wholes].sum())
    if whole_work <= 0:
        return None
    ring_forward = _ring_forward(placed, lengths, model)
    whole_forward = float(model.whole_forward_seconds(lengths[wholes]).sum())
    share = (float(ring_forward.sum()) + whole_forward) / (float(placed.load.sum()) + whole_work)
    room = np.maximum(level - placed.load, 0.0)
    forward_room = np.maximum(level * share - ring_forward, 0.0) / (whole_forward / whole_work)
    offsets = np.clip(room - forward_room, 0.0, room)
    return offsets if offsets.any() else None


def phase_seconds(placed: Placed, lengths: np.ndarray, model: WorkModel) -> float:
    """The forward's busiest rank plus the backward's, as the work model costs them."""
    forward = np.zeros(placed.load.size)
    if placed.groups:
        forward += _ring_forward(placed, lengths, model)
    if placed.local:
        seqs = np.fromiter(placed.local.keys(), dtype=np.int64, count=len(placed.local))
        ranks = np.fromiter(placed.local.values(), dtype=np.int64, count=len(placed.local))
        np.add.at(forward, ranks, model.whole_forward_seconds(lengths[seqs]))
    return float(forward.max() + (placed.load - forward).max())


def _ring_forward(placed: Placed, lengths: np.ndarray, model: WorkModel) -> np.ndarray:
    """Each rank's forward seconds in the rings of `placed`: every ring (its ranks and U)
    costed over the sequences it holds, as one queue item."""
    gpus = model.cost.topology.gpus_per_node
    items: dict[tuple[tuple[int, ...], int], int] = {}
    seqs = np.fromiter(placed.groups.keys(), dtype=np.int64, count=len(placed.groups))
    item = np.empty(seqs.size, dtype=np.int64)
    positions = np.empty(seqs.size, dtype=np.int64)
    for i, seq in enumerate(seqs.tolist()):
        ranks = placed.groups[seq][0]
        u = placed.ulysses.get(seq, 1)
        item[i] = items.setdefault((ranks, u), len(items))
        positions[i] = len(ranks) // u
    n = lengths[seqs].astype(np.float64)
    parts = model.ring_parts(n, positions)
    sums = np.zeros((4, len(items)))
    for row, values in enumerate((parts.diagonal_s, parts.step_s, parts.send_bytes, n)):
        np.add.at(sums[row], item, values)
    keys = list(items)
    degree = np.fromiter((len(ranks) for ranks, _ in keys), dtype=np.int64, count=len(keys))
    u = np.fromiter((u for _, u in keys), dtype=np.int64, count=len(keys))
    spans = np.fromiter((ranks[0] // gpus != ranks[-1] // gpus for ranks, _ in keys), dtype=bool,
                        count=len(keys))  # fmt: skip
    summed = RingParts(sums[0], sums[1], sums[2])
    count = degree // u
    tokens = sums[3] / degree
    forward = np.where(
        spans,
        model.ring_forward_seconds(summed, tokens, count, LinkKind.INTER_NODE),
        model.ring_forward_seconds(summed, tokens, count, LinkKind.INTRA_NODE),
    )
    usp = u > 1
    if usp.any():
        heads = RingParts(sums[0][usp], sums[1][usp], sums[2][usp])
        forward[usp] = model.usp_group_forward_seconds(heads, sums[3][usp], count[usp], u[usp])
    out = np.zeros(placed.load.size)
    flat = np.fromiter((rank for ranks, _ in keys for rank in ranks), dtype=np.int64,
                       count=int(degree.sum()))  # fmt: skip
    np.add.at(out, flat, np.repeat(forward, degree))
    return out
