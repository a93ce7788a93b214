"""Whole sequences on ranks by modelled work (`whole` under `parallel.zone_policy=work`).

The data stream packs a batch's sequences into one bin of at most L tokens per rank
(`data.packing=rank`), balancing nothing but the fit. Under the work policy the
sequences are dealt again, costliest first (`WorkModel.whole_seconds`: linear and
causal attention at the per-length rates), each onto the rank with the least work
that still has room for its tokens. Where that greedy deal cannot fit every
sequence under L (bin packing is hard; the stream's first fit found a way), the
stream's bins stay.
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition.fill import place_whole
from ray_zep.partition.work import WorkModel


def work_bins(
    lengths: np.ndarray, world: int, capacity: int, model: WorkModel
) -> list[list[int]] | None:
    """Each rank's sequences, dealt by work under `capacity` tokens per rank; None when
    the deal cannot fit them all."""
    lengths = np.asarray(lengths, dtype=np.int64)
    seconds = model.whole_seconds(lengths)
    order = np.argsort(-seconds, kind="stable")
    dealt = place_whole(lengths[order].tolist(), world, capacity, seconds[order].tolist())
    if dealt is None:
        return None
    bins: list[list[int]] = [[] for _ in range(world)]
    for seq, rank in zip(order.tolist(), dealt[0], strict=True):
        bins[rank].append(seq)
    return bins
