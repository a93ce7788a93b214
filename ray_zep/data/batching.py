"""Global batches filled to the token budget, deterministic and resumable.

Documents are visited in a seeded order that is new every epoch (or in source
order with `data.shuffle=false`). Each document is cut into pieces of at most
`max_doc_tokens` (`data.overlong=split`), skipped (`drop`) or refused (`error`)
when longer. Pieces are admitted into the current batch in order:

- `packing=budget`: while the batch holds at most nodes x GPUs x L tokens;
- `packing=rank`: first-fit into one bin of L tokens per rank.

A whole document (at most `max_doc_tokens`) that fits nowhere closes the
batch and opens the next one. A document that is being split anyway
(`overlong=split`) is cut where the batch runs out instead: its next piece takes
the largest free space, so long documents never leave batches part empty.
Either way nothing is skipped or repeated.

The `Cursor` (epoch, position in the epoch's order, tokens of the current
document already used) is all the state there is: a stream rebuilt from a
saved cursor yields exactly the batches that would have followed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ray_zep.config import Config, Overlong, Packing
from ray_zep.data.source import TokenSource
from ray_zep.errors import ConfigError, EmptyDatasetError, OverlongDocumentError


@dataclass(frozen=True)
class Cursor:
    """Position of a batch stream: everything before it has been batched."""

    epoch: int = 0
    index: int = 0
    """Position in the epoch's visiting order."""
    offset: int = 0
    """Tokens of the document at `index` already placed in earlier batches."""

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> Cursor:
        return cls(**{k: int(v) for k, v in data.items()})


@dataclass(frozen=True)
class Piece:
    """A run of tokens [start, start + length) of document `doc`."""

    doc: int
    start: int
    length: int


@dataclass
class GlobalBatch:
    """The pieces one optimizer step trains on.

    Attributes:
        index: batch number from the start of the run (the step it feeds).
        pieces: the sequences, in admission order.
        tokens: int32 token ids of each piece.
        bins: under rank packing, the piece indices each rank holds.
        cursor_after: stream position after this batch.
        dropped_docs: documents skipped by `data.overlong=drop` while filling it.
    """

    index: int
    pieces: list[Piece]
    tokens: list[np.ndarray]
    bins: list[list[int]] | None
    cursor_after: Cursor
    dropped_docs: int = 0

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray([p.length for p in self.pieces], dtype=np.int64)

    @property
    def total_tokens(self) -> int:
        return int(sum(p.length for p in self.pieces))

    @property
    def label_tokens(self) -> int:
        """Positions with a next token to predict (all but each sequence's last)."""
        return int(sum(p.length - 1 for p in self.pieces))


@dataclass
class _Order:
    epoch: int = -1
    docs: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


class BatchStream:
    """Yields GlobalBatches from a token source.

    Args:
        source: where documents come from.
        world: number of ranks (nodes x GPUs of the topology).
        tokens_per_rank: L.
        packing: admission rule (see the module docstring).
        max_doc_tokens: longest piece; None means L under rank packing and the
            whole budget otherwise.
        overlong: policy for longer documents.
        seed: seeds the visiting order.
        shuffle: visit in a seeded random order (else in source order).
        cursor: where to start (the start of the data by default).
        start_index: number of the first batch produced.

    Raises:
        ConfigError: max_doc_tokens larger than a batch or a rank can hold.
        OverlongDocumentError: under `overlong=error`, for the first document too
            long (checked up front when the source knows its lengths).
    """

    def __init__(
        self,
        source: TokenSource,
        *,
        world: int,
        tokens_per_rank: int,
        packing: Packing,
        max_doc_tokens: int | None,
        overlong: Overlong,
        seed: int,
        shuffle: bool = True,
        cursor: Cursor | None = None,
        start_index: int = 0,
    ) -> None:
        self.source = source
        self.world = world
        self.capacity = tokens_per_rank
        self.packing = packing
        self.budget = world * tokens_per_rank
        self.max_doc = resolve_max_doc_tokens(max_doc_tokens, packing, world, tokens_per_rank)
        self.overlong = overlong
        self.seed = seed
        self.shuffle = shuffle
        self.cursor = cursor or Cursor()
        self.next_index = start_index
        self._order = _Order()
        self._dropped = 0
        if overlong is Overlong.ERROR:
            self._check_no_overlong()

    @classmethod
    def from_config(
        cls,
        source: TokenSource,
        config: Config,
        world: int,
        cursor: Cursor | None = None,
        start_index: int = 0,
    ) -> BatchStream:
        """The stream the `train` and `data` sections describe, for `world` ranks."""
        train, data = config.train, config.data
        return cls(
            source,
            world=world,
            tokens_per_rank=train.tokens_per_rank,
            packing=data.packing,
            max_doc_tokens=data.max_doc_tokens,
            overlong=data.overlong,
            seed=train.seed,
            shuffle=data.shuffle,
            cursor=cursor,
            start_index=start_index,
        )

    def next_batch(self) -> GlobalBatch:
        """The next global batch; advances the cursor past it."""
        pieces: list[Piece] = []
        tokens: list[np.ndarray] = []
        loads = [0] * (self.world if self.packing is Packing.RANK else 1)
        bins: list[list[int]] = [[] for _ in loads]
        dropped_before = self._dropped
        while True:
            piece = self._current_piece()
            slot = self._fit(loads, piece.length)
            if slot is None:
                slot, room = self._roomiest(loads)
                if room == 0 or self.source.length(piece.doc) <= self.max_doc:
                    break  # a whole document waits for the next batch
                piece = Piece(piece.doc, piece.start, room)
            loads[slot] += piece.length
            bins[slot].append(len(pieces))
            pieces.append(piece)
            tokens.append(self._piece_tokens(piece))
            self._advance(piece)
        batch = GlobalBatch(
            index=self.next_index,
            pieces=pieces,
            tokens=tokens,
            bins=bins if self.packing is Packing.RANK else None,
            cursor_after=self.cursor,
            dropped_docs=self._dropped - dropped_before,
        )
        self.next_index += 1
        return batch

    @property
    def _limit(self) -> int:
        return self.capacity if self.packing is Packing.RANK else self.budget

    def _fit(self, loads: list[int], length: int) -> int | None:
        return next((i for i, load in enumerate(loads) if load + length <= self._limit), None)

    def _roomiest(self, loads: list[int]) -> tuple[int, int]:
        """The slot with the most free tokens, and how many."""
        slot = min(range(len(loads)), key=loads.__getitem__)
        return slot, self._limit - loads[slot]

    def _current_piece(self) -> Piece:
        """The piece at the cursor, moving the cursor past empty and dropped documents."""
        skipped = 0
        while True:
            doc = self._doc_at_cursor()
            length = self.source.length(doc)
            if length > 0 and (length <= self.max_doc or self.overlong is not Overlong.DROP):
                if length > self.max_doc and self.overlong is Overlong.ERROR:
                    raise self._overlong_error(doc, length)
                size = min(length - self.cursor.offset, self.max_doc)
                return Piece(doc, self.cursor.offset, size)
            if length > 0:
                self._dropped += 1
            skipped += 1
            # The rest of this epoch plus one whole epoch: past that nothing is usable.
            if self.source.num_docs is not None and skipped > 2 * self.source.num_docs:
                raise EmptyDatasetError(
                    f"every document of {self.source.name!r} is longer than "
                    f"data.max_doc_tokens={self.max_doc} and data.overlong=drop drops them all"
                )
            self.cursor = Cursor(self.cursor.epoch, self.cursor.index + 1, 0)

    def _advance(self, piece: Piece) -> None:
        offset = piece.start + piece.length
        if offset >= self.source.length(piece.doc):
            self.cursor = Cursor(self.cursor.epoch, self.cursor.index + 1, 0)
        else:
            self.cursor = Cursor(self.cursor.epoch, self.cursor.index, offset)

    def _doc_at_cursor(self) -> int:
        num_docs = self.source.num_docs
        if num_docs is None:
            return self.cursor.index
        if self.cursor.index >= num_docs:
            self.cursor = Cursor(self.cursor.epoch + 1, 0, 0)
        if self._order.epoch != self.cursor.epoch:
            self._order = _Order(self.cursor.epoch, self._visit_order(self.cursor.epoch, num_docs))
        return int(self._order.docs[self.cursor.index])

    def _visit_order(self, epoch: int, num_docs: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(num_docs, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(num_docs)

    def _piece_tokens(self, piece: Piece) -> np.ndarray:
        return self.source.tokens(piece.doc)[piece.start : piece.start + piece.length]

    def _check_no_overlong(self) -> None:
        longest = self.source.max_length()
        if longest is None or longest <= self.max_doc:
            return
        for doc in range(self.source.num_docs or 0):
            if self.source.length(doc) > self.max_doc:
                raise self._overlong_error(doc, self.source.length(doc))

    def _overlong_error(self, doc: int, length: int) -> OverlongDocumentError:
        return OverlongDocumentError(
            f"document {doc} of {self.source.name!r} has {length} tokens, more than "
            f"data.max_doc_tokens={self.max_doc}, and data.overlong=error; set "
            "data.overlong=split (or drop), or raise train.tokens_per_rank"
        )


def resolve_max_doc_tokens(
    value: int | None, packing: Packing, world: int, tokens_per_rank: int
) -> int:
    """`data.max_doc_tokens`, defaulted and checked against what a batch can hold."""
    if packing is Packing.RANK:
        limit, what = tokens_per_rank, "train.tokens_per_rank (one rank's bin under packing=rank)"
    else:
        limit, what = world * tokens_per_rank, "the batch budget nodes x GPUs x L"
    if value is None:
        return limit
    if value > limit:
        raise ConfigError(f"config key data.max_doc_tokens={value}: exceeds {limit}, {what}")
    return value
