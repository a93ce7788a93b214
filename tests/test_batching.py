"""Global batches: budget, rank bins, overlong policies, cursor resume, per-rank shards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_zep.config import Overlong, Packing
from ray_zep.constants import IGNORE_INDEX
from ray_zep.data.batching import BatchStream, Cursor
from ray_zep.data.builder import write_token_parquet
from ray_zep.data.shards import shard_batch
from ray_zep.data.source import ParquetSource
from ray_zep.data.synthetic import SyntheticSource
from ray_zep.errors import ConfigError, EmptyDatasetError, OverlongDocumentError, PlacementError
from ray_zep.parallel.axes import Placement
from tests.helpers.samples import assert_each_token_once_per_epoch

pytestmark = pytest.mark.unit


class ListSource:
    """In-memory documents, for tests."""

    def __init__(self, lengths: list[int]) -> None:
        self.name = "list"
        self._docs = [np.arange(n, dtype=np.int32) + 1000 * i for i, n in enumerate(lengths)]
        self.num_docs = len(lengths)

    def length(self, doc: int) -> int:
        return len(self._docs[doc])

    def tokens(self, doc: int) -> np.ndarray:
        return self._docs[doc]

    def max_length(self) -> int:
        return max(len(d) for d in self._docs)


def _stream(
    docs: list[int] | object,
    packing=Packing.BUDGET,
    world=2,
    capacity=10,
    max_doc=None,
    overlong=Overlong.SPLIT,
    seed=0,
    shuffle=True,
    cursor=None,
):
    """A stream over `docs`: a list of document lengths, or any token source."""
    source = ListSource(docs) if isinstance(docs, list) else docs
    return BatchStream(
        source,
        world=world,
        tokens_per_rank=capacity,
        packing=packing,
        max_doc_tokens=max_doc,
        overlong=overlong,
        seed=seed,
        shuffle=shuffle,
        cursor=cursor,
    )


def _pieces(batches) -> list[tuple[int, int, int]]:
    return [(p.doc, p.start, p.length) for b in batches for p in b.pieces]


def test_budget_packing_fills_to_the_budget_and_carries_the_rest() -> None:
    stream = _stream([6, 9, 4, 3, 8], shuffle=False)
    first, second = stream.next_batch(), stream.next_batch()
    assert [p.doc for p in first.pieces] == [0, 1, 2]  # 6 + 9 + 4 = 19 <= 20; +3 would be 22
    assert first.total_tokens == 19 and first.bins is None
    assert [p.doc for p in second.pieces] == [3, 4, 0]
    assert first.label_tokens == 19 - 3


def test_rank_packing_first_fits_whole_sequences_into_bins() -> None:
    stream = _stream([6, 9, 4, 3, 8], packing=Packing.RANK, shuffle=False)
    batch = stream.next_batch()
    assert batch.bins == [[0, 2], [1]]  # 6+4 | 9: doc 3 (3 tokens) fits no bin
    assert [p.doc for p in batch.pieces] == [0, 1, 2]
    nxt = stream.next_batch()
    assert nxt.pieces[0].doc == 3  # it opens the next batch


def test_overlong_policies() -> None:
    split = _stream([25, 3], max_doc=10, shuffle=False)
    assert _pieces([split.next_batch()]) == [(0, 0, 10), (0, 10, 10)]
    # the next epoch's first piece of doc 0 is cut to the 2 tokens left in the budget
    assert _pieces([split.next_batch()]) == [(0, 20, 5), (1, 0, 3), (0, 0, 10), (0, 10, 2)]
    assert _pieces([split.next_batch()])[0] == (0, 12, 10)
    drop = _stream([25, 3, 4], max_doc=10, overlong=Overlong.DROP, shuffle=False)
    batch = drop.next_batch()
    # 7 tokens survive per epoch, so a 20-token batch spans three epochs and drops doc 0 thrice
    assert _pieces([batch]) == [(1, 0, 3), (2, 0, 4)] * 2 + [(1, 0, 3)]
    assert batch.dropped_docs == 3
    with pytest.raises(OverlongDocumentError, match=r"document 0 of 'list' has 25 tokens"):
        _stream([25, 3], max_doc=10, overlong=Overlong.ERROR)
    with pytest.raises(EmptyDatasetError, match="drops them all"):
        _stream([25, 30], max_doc=10, overlong=Overlong.DROP).next_batch()


def test_overlong_error_on_an_endless_source_is_raised_when_met() -> None:
    stream = _stream(SyntheticSource("github", 64, seed=0), capacity=512, overlong=Overlong.ERROR)
    with pytest.raises(OverlongDocumentError, match=r"more than data\.max_doc_tokens=1024"):
        for _ in range(50):
            stream.next_batch()


def test_max_doc_tokens_is_checked_against_capacity() -> None:
    with pytest.raises(ConfigError, match=r"data\.max_doc_tokens=11: exceeds 10"):
        _stream([3], packing=Packing.RANK, max_doc=11)
    with pytest.raises(ConfigError, match=r"data\.max_doc_tokens=21: exceeds 20"):
        _stream([3], max_doc=21)


def test_order_is_seeded_and_changes_every_epoch() -> None:
    lengths = [3] * 12
    a = _pieces(_stream(lengths, seed=1).next_batch() for _ in range(3))
    b = _pieces(_stream(lengths, seed=1).next_batch() for _ in range(3))
    c = _pieces(_stream(lengths, seed=2).next_batch() for _ in range(3))
    assert a == b and a != c
    stream = _stream(lengths, capacity=6, seed=1)  # one epoch = 3 batches of 12 tokens
    epochs = [[p[0] for p in _pieces(stream.next_batch() for _ in range(3))] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(12))
    assert epochs[0] != epochs[1]


def test_a_stream_rebuilt_from_a_cursor_continues_exactly() -> None:
    lengths = [7, 1, 0, 15, 2, 9, 4, 11, 3]
    stream = _stream(lengths, max_doc=8, seed=3)
    batches = [stream.next_batch() for _ in range(8)]
    resumed = _stream(lengths, max_doc=8, seed=3, cursor=batches[2].cursor_after)
    assert _pieces(resumed.next_batch() for _ in range(5)) == _pieces(batches[3:])
    assert Cursor.from_dict(batches[4].cursor_after.to_dict()) == batches[4].cursor_after


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=25).filter(any),
    world=st.integers(min_value=1, max_value=4),
    capacity=st.integers(min_value=2, max_value=24),
    packing=st.sampled_from([Packing.BUDGET, Packing.RANK]),
    seed=st.integers(min_value=0, max_value=3),
)
def test_every_token_is_placed_once_within_capacity(lengths, world, capacity, packing, seed):
    stream = _stream(lengths, packing=packing, world=world, capacity=capacity, seed=seed)
    batches = [stream.next_batch() for _ in range(12)]
    assert_each_token_once_per_epoch(_pieces(batches), dict(enumerate(lengths)))
    for batch in batches:
        assert batch.pieces, "a batch is never empty"
        assert all(1 <= p.length <= stream.max_doc for p in batch.pieces)
        assert batch.total_tokens <= world * capacity
        if packing is Packing.RANK:
            loads = [sum(batch.pieces[i].length for i in b) for b in batch.bins]
            assert max(loads) <= capacity
            assert sorted(i for b in batch.bins for i in b) == list(range(len(batch.pieces)))
        for piece, tokens in zip(batch.pieces, batch.tokens, strict=True):
            assert tokens.tolist() == list(
                range(1000 * piece.doc + piece.start, 1000 * piece.doc + piece.start + piece.length)
            )


def test_shards_of_dp_and_single() -> None:
    stream = _stream([6, 9, 4, 3, 8], packing=Packing.RANK, shuffle=False)
    batch = stream.next_batch()
    dp = shard_batch(batch, Placement.WHOLE, world=2)
    assert [s.lengths.tolist() for s in dp] == [[6, 4], [9]]
    assert [s.rank_tokens for s in dp] == [(10, 9), (10, 9)]
    assert all(s.global_label_tokens == 19 - 3 and s.global_tokens == 19 for s in dp)
    assert dp[0].positions().tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    labels = dp[0].labels()
    assert labels[:5].tolist() == dp[0].tokens[1:6].tolist()
    assert labels[5] == IGNORE_INDEX and labels[9] == IGNORE_INDEX
    assert (labels != IGNORE_INDEX).sum() == 10 - 2
    (single,) = shard_batch(batch, Placement.SINGLE, world=2)
    assert single.num_tokens == 19 and single.docs.tolist() == [0, 1, 2]
    with pytest.raises(PlacementError, match=r"data\.packing=rank"):
        shard_batch(_stream([3, 4]).next_batch(), Placement.WHOLE, world=2)


def test_parquet_stream_with_empty_rows(tmp_path: Path) -> None:
    path = write_token_parquet(
        [np.arange(n, dtype=np.int32) for n in (5, 0, 7, 0, 2)], tmp_path / "d.parquet"
    ).path
    source = ParquetSource(path)
    stream = _stream(source, packing=Packing.RANK, world=1, capacity=6)
    pieces = _pieces(stream.next_batch() for _ in range(6))
    assert_each_token_once_per_epoch(pieces, dict(enumerate(source.lengths.tolist())))
    assert all(doc not in (1, 3) for doc, _, _ in pieces)


@pytest.mark.parametrize("packing", [Packing.RANK, Packing.BUDGET])
def test_split_documents_fill_batches_completely(packing: Packing) -> None:
    stream = _stream(
        [25, 3, 37, 1, 52], packing=packing, world=2, capacity=10, max_doc=10, shuffle=False
    )
    for _ in range(8):
        batch = stream.next_batch()
        if packing is Packing.RANK:
            assert [sum(batch.pieces[i].length for i in b) for b in batch.bins] == [10, 10]
        else:
            assert batch.total_tokens == 20


def test_empty_documents_across_an_epoch_boundary_are_skipped() -> None:
    """The only non-empty document may sit behind the empty ones of this epoch and of
    the next one (found by the property test above)."""
    stream = _stream([0, 0, 1], world=1, capacity=2, seed=0)
    batches = [stream.next_batch() for _ in range(6)]
    assert all(p.doc == 2 and p.length == 1 for b in batches for p in b.pieces)
