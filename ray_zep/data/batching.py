"""Global batches filled to the token budget, deterministic and resumable.

Documents are visited in a seeded order that is new every epoch (or in source
order with `data.shuffle=false`). Each document is cut into pieces of at most
`max_doc_tokens` (`data.overlong=split`), skipped (`drop`) or refused (`error`)
when longer. Pieces are admitted into the current batch in order:

- `packing=budget`: while the batch holds at most nodes x GPUs x L tokens (times
  `data.batch_fill`);
- `packing=rank`: first-fit into one bin of L tokens per rank.

A whole document (at most `max_doc_tokens`) that fits nowhere closes the
batch and opens the next one. A document that is being split anyway
(`overlong=split`) is cut where the batch runs out instead: its next piece takes
the largest free space, so long documents never leave batches part empty.
Either way nothing is skipped or repeated.

Outlier delay (`data.outlier_tokens` > 0, off by default), after WLB-LLM (Wang et
al., OSDI'25, arXiv 2503.17924, outlier document delay): a whole document of at
least that many tokens met while filling a batch is held back instead, up to
`data.outlier_group` of them. The held documents open a later batch together, in
the order they were met, once `outlier_group` wait, once the oldest has waited
`data.outlier_max_delay` batches, or when the epoch ends (every document still
comes once per epoch). A batch then holds several outliers the planner can give
equal rank groups, instead of one outlier beside short documents in one batch
and none in the next. Further outliers met while the queue is full are admitted
where they are met, so nothing waits without bound.

The `Cursor` (epoch, position in the epoch's order, tokens of the current
document already used, the held outliers) is all the state there is: a stream
rebuilt from a saved cursor yields exactly the batches that would have followed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from ray_zep.config import Config, Overlong, Packing, batch_budget
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
    held: tuple[tuple[int, int], ...] = ()
    """Outliers held back, oldest first: (document, index of the batch that passed it)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cursor:
        held = tuple((int(doc), int(at)) for doc, at in data.get("held", ()))
        return cls(**{k: int(v) for k, v in data.items() if k != "held"}, held=held)

    def moved(self, index: int, offset: int = 0) -> Cursor:
        """This cursor at another position of its epoch, holding the same outliers."""
        return Cursor(self.epoch, index, offset, self.held)


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


@dataclass(frozen=True)
class OutlierDelay:
    """`data.outlier_tokens`, `data.outlier_group`, `data.outlier_max_delay` (module
    docstring)."""

    tokens: int
    group: int = 2
    max_delay: int = 4

    @classmethod
    def from_config(cls, data) -> OutlierDelay | None:
        """The delay `data` (a `DataConfig`) asks for; None when it is off."""
        if data.outlier_tokens <= 0:
            return None
        return cls(data.outlier_tokens, data.outlier_group, data.outlier_max_delay)


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
        outliers: outlier delay (module docstring); None: off.
        fill: share of world x `tokens_per_rank` a batch fills under budget packing.

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
        outliers: OutlierDelay | None = None,
        fill: float = 1.0,
    ) -> None:
        self.source = source
        self.outliers = outliers
        self.world = world
        self.capacity = tokens_per_rank
        self.packing = packing
        self.budget = batch_budget(fill, world, tokens_per_rank)
        self.max_doc = resolve_max_doc_tokens(max_doc_tokens, packing, self.budget, tokens_per_rank)
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
            outliers=OutlierDelay.from_config(data),
            fill=data.batch_fill,
        )

    def next_batch(self) -> GlobalBatch:
        """The next global batch; advances the cursor past it."""
        pieces: list[Piece] = []
        tokens: list[np.ndarray] = []
        loads = [0] * (self.world if self.packing is Packing.RANK else 1)
        bins: list[list[int]] = [[] for _ in loads]
        dropped_before = self._dropped

        def place(piece: Piece, slot: int) -> None:
            loads[slot] += piece.length
            bins[slot].append(len(pieces))
            pieces.append(piece)
            tokens.append(self._piece_tokens(piece))

        full = self._release_due() and not self._release(loads, place)
        while not full:
            piece = self._current_piece()
            if piece is None:  # the epoch ends with outliers held: they come first
                full = not self._release(loads, place)
                continue
            if self._holds(piece):
                self._advance(piece)
                held = (*self.cursor.held, (piece.doc, self.next_index))
                self.cursor = replace(self.cursor, held=held)
                continue
            slot = self._fit(loads, piece.length)
            if slot is None:
                slot, room = self._roomiest(loads)
                if room == 0 or self.source.length(piece.doc) <= self.max_doc:
                    break  # a whole document waits for the next batch
                piece = Piece(piece.doc, piece.start, room)
            place(piece, slot)
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

    def _holds(self, piece: Piece) -> bool:
        """Whether `piece` is an outlier to hold back: a whole document of at least
        `outliers.tokens`, with room in the queue."""
        delay = self.outliers
        return (
            delay is not None
            and piece.start == 0
            and piece.length >= delay.tokens
            and piece.length == self.source.length(piece.doc)
            and len(self.cursor.held) < delay.group
        )

    def _release_due(self) -> bool:
        """Whether the held outliers open this batch: a full group, or the oldest has
        waited `outliers.max_delay` batches."""
        held, delay = self.cursor.held, self.outliers
        if not held or delay is None:
            return bool(held)  # a stream resumed with the delay off still places them
        return len(held) >= delay.group or self.next_index - held[0][1] >= delay.max_delay

    def _release(self, loads: list[int], place) -> bool:
        """Place the held outliers, oldest first, while they fit; whether all did."""
        held = list(self.cursor.held)
        while held:
            doc = held[0][0]
            piece = Piece(doc, 0, self.source.length(doc))
            slot = self._fit(loads, piece.length)
            if slot is None:
                break
            place(piece, slot)
            held.pop(0)
        self.cursor = replace(self.cursor, held=tuple(held))
        return not held

    @property
    def _limit(self) -> int:
        return self.capacity if self.packing is Packing.RANK else self.budget

    def _fit(self, loads: list[int], length: int) -> int | None:
        return next((i for i, load in enumerate(loads) if load + length <= self._limit), None)

    def _roomiest(self, loads: list[int]) -> tuple[int, int]:
        """The slot with the most free tokens, and how many."""
        slot = min(range(len(loads)), key=loads.__getitem__)
        return slot, self._limit - loads[slot]

    def _current_piece(self) -> Piece | None:
        """The piece at the cursor, moving the cursor past empty and dropped documents;
        None at the end of an epoch while outliers are held (they come first)."""
        skipped = 0
        while True:
            doc = self._doc_at_cursor()
            if doc is None:
                return None
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
            self.cursor = self.cursor.moved(self.cursor.index + 1)

    def _advance(self, piece: Piece) -> None:
        offset = piece.start + piece.length
        if offset >= self.source.length(piece.doc):
            self.cursor = self.cursor.moved(self.cursor.index + 1)
        else:
            self.cursor = self.cursor.moved(self.cursor.index, offset)

    def _doc_at_cursor(self) -> int | None:
        """The document at the cursor, starting the next epoch past the last one; None
        at the end of an epoch while outliers are held."""
        num_docs = self.source.num_docs
        if num_docs is None:
            return self.cursor.index
        if self.cursor.index >= num_docs:
            if self.cursor.held:
                return None
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
    value: int | None, packing: Packing, budget: int, tokens_per_rank: int
) -> int:
    """`data.max_doc_tokens`, defaulted and checked against what a batch can hold
    (`budget`: a batch's tokens under budget packing)."""
    if packing is Packing.RANK:
        limit, what = tokens_per_rank, "train.tokens_per_rank (one rank's bin under packing=rank)"
    else:
        limit, what = budget, "the batch budget nodes x GPUs x L x data.batch_fill"
    if value is None:
        return limit
    if value > limit:
        raise ConfigError(f"config key data.max_doc_tokens={value}: exceeds {limit}, {what}")
    return value
