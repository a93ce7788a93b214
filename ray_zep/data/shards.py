"""Per-rank shards of a global batch.

A shard is what one rank trains on in one step: its packed token ids, the
length of each sequence, and where each sequence comes from (document and
offset: the sample ids). Positions and labels are derived on the rank with
vectorised numpy, never per document.

Placement by `parallel.sequence` (ray_zep.parallel.axes):
- the one-process reference: one shard holding the whole batch.
- whole sequences: rank r holds bin r of a rank-packed batch, at most L tokens.
- every planned placement: the step's plan (`ray_zep.step_plan`) places
  the batch and rank r holds the fragments of its plan layout, with explicit positions and
  next-token labels taken from the whole sequences (a fragment's last label is
  the first token of the next fragment, wherever that lives), and its slice of
  the plan;
- with `parallel.routing` a shard also carries the routed ring transfers the rank
  sends, receives or relays; with `parallel.remap` its token ids, positions and
  labels are in the balanced linear layout (`ray_zep.remap.layout`) while
  `lengths`, `docs` and `starts` still describe its attention-layout fragments.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_zep.attention.varlen import positions_from_lengths
from ray_zep.config import Config
from ray_zep.constants import IGNORE_INDEX
from ray_zep.data.batching import GlobalBatch
from ray_zep.errors import PlacementError
from ray_zep.model_shapes import build_shape
from ray_zep.moe.gate import RoutingGroups
from ray_zep.parallel.axes import SEQUENCE_AXES, Placement
from ray_zep.partition.plan import AttentionPlan, Fragment
from ray_zep.remap.layout import RankRemap, to_linear_layout
from ray_zep.remap.solver import RemapPlan
from ray_zep.routing.routes import RankRouting
from ray_zep.step_plan import plan_step, whole_bins
from ray_zep.topology import Topology
from ray_zep.traffic import Traffic


@dataclass
class RankShard:
    """One rank's part of one step.

    Attributes:
        step: the step (batch index) this shard belongs to.
        rank: the rank that trains on it.
        tokens: int32 token ids of the rank's sequences, packed.
        lengths: int64 length of each sequence (all >= 1).
        docs: int64 document id of each sequence.
        starts: int64 offset of each sequence inside its document.
        global_tokens: tokens of the whole global batch.
        global_label_tokens: label positions of the whole global batch (the
            loss normaliser).
        rank_tokens: every rank's token count this step.
        cursor_after: data cursor after this step's batch (for checkpoints).
    """

    step: int
    rank: int
    tokens: np.ndarray
    lengths: np.ndarray
    docs: np.ndarray
    starts: np.ndarray
    global_tokens: int
    global_label_tokens: int
    rank_tokens: tuple[int, ...]
    cursor_after: dict[str, Any]
    plan: AttentionPlan | None = None
    """This rank's slice of the batch's plan (None: whole sequences, local attention)."""
    position_ids: np.ndarray | None = None
    label_ids: np.ndarray | None = None
    routing: RankRouting | None = None
    """Routed ring transfers this rank takes part in (`parallel.routing`)."""
    remap: RankRemap | None = None
    """This rank's part of the linear <-> attention layout transfer (`parallel.remap`)."""
    traffic: tuple[Traffic, Traffic] | None = None
    """Whole-job attention and remap bytes of the step, as `attention_step_parts` gives them."""
    routing_groups: RoutingGroups | None = None
    """The one-process reference: the MoE routing groups of the run it mirrors."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def positions(self) -> np.ndarray:
        """int64 position of every token inside its sequence."""
        if self.position_ids is not None:
            return self.position_ids
        return positions_from_lengths(self.lengths)

    def labels(self) -> np.ndarray:
        """int64 next-token labels; IGNORE_INDEX at the last token of each sequence."""
        if self.label_ids is not None:
            return self.label_ids
        labels = np.empty(self.num_tokens, dtype=np.int64)
        if self.num_tokens:
            labels[:-1] = self.tokens[1:]
            labels[np.cumsum(self.lengths) - 1] = IGNORE_INDEX
        return labels


def shard_batch(batch: GlobalBatch, placement: Placement, world: int) -> list[RankShard]:
    """Split a global batch into the shards of every rank under a whole-sequence placement.

    Raises:
        PlacementError: a batch that was not rank-packed for `world` ranks, or a
            planned placement (see `shard_for`).
    """
    axis = SEQUENCE_AXES[placement]
    if axis.one_process:
        groups = [list(range(len(batch.pieces)))]
    elif axis.whole_sequences:
        if batch.bins is None or len(batch.bins) != world:
            raise PlacementError(
                f"parallel.sequence={axis.name} needs a batch rank-packed for {world} ranks "
                "(data.packing=rank)"
            )
        groups = batch.bins
    else:
        raise PlacementError(f"parallel.sequence={axis.name} is planned: use shard_for")
    rank_tokens = tuple(int(sum(batch.pieces[i].length for i in g)) for g in groups)
    return [_shard(batch, rank, group, rank_tokens) for rank, group in enumerate(groups)]


def _shard(
    batch: GlobalBatch, rank: int, group: list[int], rank_tokens: tuple[int, ...]
) -> RankShard:
    pieces = [batch.pieces[i] for i in group]
    tokens = [batch.tokens[i] for i in group]
    return RankShard(
        step=batch.index,
        rank=rank,
        tokens=np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int32),
        lengths=np.asarray([p.length for p in pieces], dtype=np.int64),
        docs=np.asarray([p.doc for p in pieces], dtype=np.int64),
        starts=np.asarray([p.start for p in pieces], dtype=np.int64),
        global_tokens=batch.total_tokens,
        global_label_tokens=batch.label_tokens,
        rank_tokens=rank_tokens,
        cursor_after=batch.cursor_after.to_dict(),
    )


def shard_for(batch: GlobalBatch, config: Config, topology: Topology) -> list[RankShard]:
    """Every rank's shard of `batch` under `config.parallel.sequence`.

    Raises:
        PlacementError: the batch does not fit the placement.
        ConfigError: the placement's rules (e.g. Ulysses head counts) fail.
    """
    placement = config.parallel.sequence
    axis = SEQUENCE_AXES[placement]
    if axis.whole_sequences:
        if not axis.one_process:
            bins = whole_bins(
                batch.lengths, batch.bins, config, topology, build_shape(config.model)
            )
            batch = dataclasses.replace(batch, bins=bins)
        shards = shard_batch(batch, placement, 1 if axis.one_process else topology.world_size)
        if axis.one_process and config.parallel.reference_layout is not None:
            shards[0].routing_groups = reference_groups(batch, config, topology)
        return shards
    step = plan_step(batch.lengths, config, topology, build_shape(config.model))
    plan = step.attention
    rank_tokens = tuple(int(n) for n in plan.rank_tokens())
    shards = [_planned_shard(batch, plan, rank, rank_tokens) for rank in range(topology.world_size)]
    for shard in shards:
        if step.routing is not None:
            shard.routing = step.routing.for_rank(shard.rank)
        shard.traffic = step.traffic
    if step.remap is not None:
        _remap_shards(shards, step.remap)
    return shards


def reference_groups(batch: GlobalBatch, config: Config, topology: Topology) -> RoutingGroups:
    """The routing groups of the run the reference mirrors (`parallel.reference_layout`):
    every rank's tokens in its linear layout, by their index in the reference's shard.

    The mirrored run is sharded as the data actor shards it, on a copy of the batch
    whose token ids are replaced by the tokens' indices.
    """
    bounds = np.cumsum([0, *(len(t) for t in batch.tokens)])
    indexed = dataclasses.replace(
        batch, tokens=[np.arange(a, b, dtype=np.int64) for a, b in itertools.pairwise(bounds)]
    )
    parallel = dataclasses.replace(
        config.parallel, sequence=config.parallel.reference_layout, reference_layout=None
    )
    shards = shard_for(indexed, dataclasses.replace(config, parallel=parallel), topology)
    order = [s.tokens.astype(np.int64) for s in shards]
    return RoutingGroups(np.concatenate(order), tuple(len(o) for o in order))


def _remap_shards(shards: list[RankShard], plan: RemapPlan) -> None:
    """Move every shard's token ids, positions and labels into the linear layout."""
    for field in ("tokens", "position_ids", "label_ids"):
        arrays = to_linear_layout([getattr(s, field) for s in shards], plan)
        for shard, array in zip(shards, arrays, strict=True):
            setattr(shard, field, array)
    for shard in shards:
        shard.remap = RankRemap.from_plan(plan, shard.rank)


def _planned_shard(
    batch: GlobalBatch, plan: AttentionPlan, rank: int, rank_tokens: tuple[int, ...]
) -> RankShard:
    fragments = plan.layout(rank)
    tokens, labels = [], []
    for f in fragments:
        seq_tokens = batch.tokens[f.seq]
        tokens.append(seq_tokens[f.start : f.end])
        labels.append(_fragment_labels(seq_tokens, f))
    empty = np.zeros(0, dtype=np.int64)
    return RankShard(
        step=batch.index,
        rank=rank,
        tokens=np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int32),
        lengths=np.asarray([f.length for f in fragments], dtype=np.int64),
        docs=np.asarray([batch.pieces[f.seq].doc for f in fragments], dtype=np.int64),
        starts=np.asarray([batch.pieces[f.seq].start + f.start for f in fragments], dtype=np.int64),
        global_tokens=batch.total_tokens,
        global_label_tokens=batch.label_tokens,
        rank_tokens=rank_tokens,
        cursor_after=batch.cursor_after.to_dict(),
        plan=plan.slice_for(rank),
        position_ids=np.concatenate([np.arange(f.start, f.end) for f in fragments])
        if fragments
        else empty,
        label_ids=np.concatenate(labels) if labels else empty,
    )


def _fragment_labels(seq_tokens: np.ndarray, fragment: Fragment) -> np.ndarray:
    labels = np.full(fragment.length, IGNORE_INDEX, dtype=np.int64)
    last = min(fragment.end, len(seq_tokens) - 1)
    labels[: last - fragment.start] = seq_tokens[fragment.start + 1 : last + 1]
    return labels
