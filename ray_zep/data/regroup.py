"""A global batch of the configured topology, trained on fewer ranks.

When a run continues on fewer nodes than `topology.nodes` (an elastic worker group
that lost one), every step still trains the global batch the configured topology
would have trained: the batch is cut into micro-batches that each fit the live ranks,
and the step accumulates their gradients (weights L_m / sum L, ray_zep.train.accumulate),
which gives the gradient of the same mean token loss.

- `packing=rank`: the configured ranks' bins in order, `live_world` of them per
  micro-batch (the last one padded with empty bins);
- `packing=budget`: the pieces in order, a micro-batch closing before the piece that
  would take it past the live budget (`data.batch_fill` x live ranks x L).
"""

from __future__ import annotations

import dataclasses

from ray_zep.config import Config, Packing, batch_budget
from ray_zep.data.batching import GlobalBatch
from ray_zep.errors import ConfigError


def regroup(batch: GlobalBatch, config: Config, world: int, live_world: int) -> list[GlobalBatch]:
    """`batch`, made for `world` ranks, as micro-batches for `live_world` ranks (itself
    when the live ranks are as many)."""
    if live_world >= world:
        return [batch]
    if config.data.packing is Packing.RANK:
        assert batch.bins is not None and len(batch.bins) == world, "rank packing has a bin a rank"
        groups = [batch.bins[i : i + live_world] for i in range(0, world, live_world)]
        return [_subset(batch, [p for b in g for p in b], _padded(g, live_world), i)
                for i, g in enumerate(groups)]  # fmt: skip
    budget = batch_budget(config.data.batch_fill, live_world, config.train.tokens_per_rank)
    micro: list[list[int]] = [[]]
    load = 0
    for index, piece in enumerate(batch.pieces):
        if piece.length > budget:
            raise ConfigError(
                f"config key data.max_doc_tokens: a piece of {piece.length} tokens does not fit "
                f"the {live_world} live ranks' budget of {budget} tokens; lower "
                "data.max_doc_tokens or keep more nodes"
            )
        if load + piece.length > budget and micro[-1]:
            micro.append([])
            load = 0
        micro[-1].append(index)
        load += piece.length
    return [_subset(batch, chosen, None, i) for i, chosen in enumerate(micro)]


def _padded(group: list[list[int]], live_world: int) -> list[list[int]]:
    return [*group, *([] for _ in range(live_world - len(group)))]


def _subset(
    batch: GlobalBatch, chosen: list[int], bins: list[list[int]] | None, part: int
) -> GlobalBatch:
    """The pieces `chosen` of `batch` (in that order), bins renumbered to them."""
    new = {old: i for i, old in enumerate(chosen)}
    return dataclasses.replace(
        batch,
        pieces=[batch.pieces[i] for i in chosen],
        tokens=[batch.tokens[i] for i in chosen],
        bins=None if bins is None else [[new[i] for i in b] for b in bins],
        dropped_docs=batch.dropped_docs if part == 0 else 0,
    )
