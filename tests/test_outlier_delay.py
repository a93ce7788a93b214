"""Outlier delay (`data.outlier_tokens`): long documents wait for a later batch, nothing
is dropped or repeated, and a stream rebuilt from a saved cursor continues exactly."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_zep.config import Overlong, Packing, load_config
from ray_zep.data.batching import BatchStream, Cursor, OutlierDelay
from ray_zep.errors import ConfigError
from tests.helpers.samples import assert_each_token_once_per_epoch
from tests.test_batching import ListSource, _pieces

pytestmark = pytest.mark.unit


def _stream(lengths, delay, packing=Packing.RANK, world=2, capacity=10, cursor=None, start=0):
    return BatchStream(
        ListSource(lengths),
        world=world,
        tokens_per_rank=capacity,
        packing=packing,
        max_doc_tokens=None,
        overlong=Overlong.SPLIT,
        seed=0,
        shuffle=False,
        cursor=cursor,
        start_index=start,
        outliers=delay,
    )


def test_outliers_wait_and_open_a_later_batch_together() -> None:
    # two ranks of 10 tokens; documents of 8+ tokens are outliers, released in pairs
    lengths = [9, 3, 3, 3, 3, 3, 3, 8, 3, 3, 3, 3, 3, 3]
    stream = _stream(lengths, OutlierDelay(8, group=2, max_delay=4))
    docs = [[p.doc for p in stream.next_batch().pieces] for _ in range(3)]
    assert docs[0] == [1, 2, 3, 4, 5, 6]  # documents 0 and 7 held back
    assert docs[1] == [0, 7]  # the pair opens the next batch, one outlier per rank
    assert docs[2][0] == 8
    plain = _stream(lengths, None)
    assert plain.next_batch().pieces[0].doc == 0  # off: in place


def test_an_outlier_waits_at_most_max_delay_batches() -> None:
    lengths = [9] + [3] * 30  # one outlier, never a second to pair with
    stream = _stream(lengths, OutlierDelay(8, group=2, max_delay=2))
    batches = [stream.next_batch() for _ in range(4)]
    where = [b.index for b in batches if any(p.doc == 0 for p in b.pieces)]
    assert where == [2]  # passed by batch 0, released when two batches have gone by
    assert batches[0].cursor_after.held == ((0, 0),)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=25).filter(any),
    world=st.integers(min_value=1, max_value=4),
    capacity=st.integers(min_value=4, max_value=24),
    packing=st.sampled_from([Packing.BUDGET, Packing.RANK]),
    threshold=st.integers(min_value=1, max_value=20),
    group=st.integers(min_value=1, max_value=3),
    max_delay=st.integers(min_value=1, max_value=3),
    resume_at=st.integers(min_value=0, max_value=10),
)
def test_every_token_once_per_epoch_and_resume_is_exact(
    lengths, world, capacity, packing, threshold, group, max_delay, resume_at
) -> None:
    delay = OutlierDelay(threshold, group, max_delay)
    stream = _stream(lengths, delay, packing, world, capacity)
    batches = [stream.next_batch() for _ in range(14)]
    assert_each_token_once_per_epoch(_pieces(batches), dict(enumerate(lengths)))
    for batch in batches:
        assert batch.pieces, "a batch is never empty"
        assert batch.total_tokens <= world * capacity
        if packing is Packing.RANK:
            loads = [sum(batch.pieces[i].length for i in b) for b in batch.bins]
            assert max(loads) <= capacity
    # the saved cursor (held outliers included) survives JSON and continues exactly
    saved = json.loads(json.dumps(batches[resume_at].cursor_after.to_dict()))
    cursor = Cursor.from_dict(saved)
    assert cursor == batches[resume_at].cursor_after
    resumed = _stream(lengths, delay, packing, world, capacity, cursor, start=resume_at + 1)
    rest = [resumed.next_batch() for _ in range(13 - resume_at)]
    assert _pieces(rest) == _pieces(batches[resume_at + 1 :])


def test_a_cursor_saved_before_the_delay_existed_still_loads() -> None:
    assert Cursor.from_dict({"epoch": 1, "index": 4, "offset": 2}) == Cursor(1, 4, 2)


def test_outlier_delay_is_off_by_default_and_checked() -> None:
    config = load_config("conf/demo.yaml", [])
    assert config.data.outlier_tokens == 0 and OutlierDelay.from_config(config.data) is None
    on = load_config("conf/demo.yaml", ["data.outlier_tokens=100", "data.outlier_group=4"])
    assert OutlierDelay.from_config(on.data) == OutlierDelay(100, 4, 4)
    for key, value in (("outlier_tokens", -1), ("outlier_group", 0), ("outlier_max_delay", 0)):
        with pytest.raises(ConfigError, match=f"data.{key}"):
            load_config("conf/demo.yaml", [f"data.{key}={value}"])


def test_batch_fill_leaves_room_under_budget_packing() -> None:
    lengths = [3] * 40
    full = _stream(lengths, None, Packing.BUDGET, world=2, capacity=10).next_batch()
    stream = BatchStream(
        ListSource(lengths), world=2, tokens_per_rank=10, packing=Packing.BUDGET,
        max_doc_tokens=None, overlong=Overlong.SPLIT, seed=0, shuffle=False, fill=0.5,
    )  # fmt: skip
    assert full.total_tokens == 18 and stream.next_batch().total_tokens == 9
    assert stream.max_doc == 10
    with pytest.raises(ConfigError, match=r"data\.batch_fill"):
        load_config("conf/demo.yaml", ["data.packing=rank", "data.batch_fill=0.8"])
    with pytest.raises(ConfigError, match=r"data\.batch_fill"):
        load_config("conf/demo.yaml", ["data.packing=budget", "data.batch_fill=0"])
