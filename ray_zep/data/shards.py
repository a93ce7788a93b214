"""Per-rank shards of a global batch.

A shard is what one rank trains on in one step: its packed token ids, the
length of each sequence, and where each sequence comes from (document and
offset: the sample ids). Positions and labels are derived on the rank with
vectorised numpy, never per document.

Placement by strategy:
- `single`: one shard holding the whole batch (the reference).
- `dp`: rank r holds bin r of a rank-packed batch: whole sequences, at most L tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_zep.attention.varlen import positions_from_lengths
from ray_zep.config import Strategy
from ray_zep.constants import IGNORE_INDEX
from ray_zep.data.batching import GlobalBatch
from ray_zep.errors import PlacementError


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
    cursor_after: dict[str, int]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def positions(self) -> np.ndarray:
        """int64 position of every token inside its sequence."""
        return positions_from_lengths(self.lengths)

    def labels(self) -> np.ndarray:
        """int64 next-token labels; IGNORE_INDEX at the last token of each sequence."""
        labels = np.empty(self.num_tokens, dtype=np.int64)
        if self.num_tokens:
            labels[:-1] = self.tokens[1:]
            labels[np.cumsum(self.lengths) - 1] = IGNORE_INDEX
        return labels


def shard_batch(batch: GlobalBatch, strategy: Strategy, world: int) -> list[RankShard]:
    """Split a global batch into the shards of every rank under `strategy`.

    Raises:
        PlacementError: dp on a batch that was not rank-packed for `world` ranks.
    """
    if strategy is Strategy.SINGLE:
        groups = [list(range(len(batch.pieces)))]
    elif strategy is Strategy.DP:
        if batch.bins is None or len(batch.bins) != world:
            raise PlacementError(
                f"strategy dp needs a batch rank-packed for {world} ranks (data.packing=rank)"
            )
        groups = batch.bins
    else:
        raise PlacementError(f"parallel.strategy={strategy.value} has no shard placement here")
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
