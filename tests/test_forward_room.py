"""The kept level's whole sequences: dealt again over the ranks in no ring
(`ray_zep.partition.spread_whole`), and placed again with each rank's forward counted
(`ray_zep.partition.forward_room`)."""

from __future__ import annotations

import numpy as np
import pytest

import ray_zep.partition.balance as balance_module
from ray_zep.data.synthetic import batch_lengths
from ray_zep.partition.forward_room import forward_offsets, phase_seconds
from ray_zep.partition.level_fill import Placed
from ray_zep.partition.spread_whole import spread_whole
from ray_zep.partition.work import WorkModel
from tests.test_balance import _cluster

pytestmark = pytest.mark.unit


def _ring_and_wholes(world: int, whole: list[tuple[int, int]], ring_load: float = 2.0):
    """A placement of `world` ranks: sequence 0 (800 tokens) on a ring over ranks 0-1,
    and whole sequences (rank, tokens) after it; work = tokens / 100."""
    lengths = np.asarray([800, *[n for _, n in whole]], dtype=np.int64)
    work = lengths / 100.0
    placed = Placed.empty(world)
    placed.groups[0] = ((0, 1), (400, 400))
    placed.in_ring[[0, 1]] = True
    placed.load[[0, 1]] = ring_load
    placed.tokens[[0, 1]] = 400
    for seq, (rank, n) in enumerate(whole, start=1):
        placed.local[seq] = rank
        placed.load[rank] += work[seq]
        placed.tokens[rank] += n
    return placed, lengths, work


def test_whole_sequences_packed_on_a_free_rank_spread_over_the_empty_ones() -> None:
    """Three whole sequences on rank 2, ranks 3-5 empty: dealt again one to a rank, the
    ring's ranks untouched; each rank's load and tokens are what it holds."""
    placed, lengths, work = _ring_and_wholes(6, [(2, 300), (2, 200), (2, 100), (0, 50)])
    ring_load = placed.load[[0, 1]].copy()
    assert spread_whole(placed, lengths, work, capacity=1000)
    assert placed.local[4] == 0  # on a ring's rank: stays
    assert sorted(placed.local[seq] for seq in (1, 2, 3)) == [2, 3, 4]
    np.testing.assert_allclose(placed.load[[0, 1]], ring_load)
    for rank in range(2, 6):
        held = [seq for seq, r in placed.local.items() if r == rank]
        assert placed.load[rank] == pytest.approx(float(work[held].sum()))
        assert placed.tokens[rank] == int(lengths[held].sum())
    assert placed.load[2:].max() == pytest.approx(3.0)


def test_a_deal_that_lowers_no_rank_or_breaks_l_is_not_taken() -> None:
    """One whole sequence a rank already: nothing to lower. A deal whose least loaded
    rank lacks the tokens for a sequence and no other has them: the fill's stays."""
    placed, lengths, work = _ring_and_wholes(4, [(2, 300), (3, 200)])
    before = dict(placed.local)
    assert not spread_whole(placed, lengths, work, capacity=1000)
    assert placed.local == before
    placed, lengths, work = _ring_and_wholes(4, [(2, 600), (2, 300), (3, 900)])
    work[1:] = [6.0, 1.0, 1.0]  # seq 2 goes beside seq 1's rank, then seq 3 fits no rank
    placed.load[2:] = [7.0, 1.0]
    before, loads = dict(placed.local), placed.load.copy()
    assert not spread_whole(placed, lengths, work, capacity=1000)
    assert placed.local == before
    np.testing.assert_array_equal(placed.load, loads)


def _work_model(nodes: int = 2) -> WorkModel:
    topology, shape = _cluster(nodes)
    return WorkModel.create(shape, topology)


def test_forward_offsets_keep_the_forward_within_the_levels_share() -> None:
    """4 nodes: a 64k-token sequence on a ring over the first two (its attention, whose
    backward is the larger share, rules its members' work) and short whole sequences to
    come, whose matmuls give their forward a larger share. The offsets never pass a
    rank's room under the level; each rank keeps the room whose whole sequences would
    bring its forward to the level's share of it, the batch's forward over its work; so
    the ranks in no ring keep less of theirs than the ring's members."""
    model = _work_model(4)
    world = model.cost.topology.world_size
    lengths = np.asarray([65_536, *([1_000] * 200)], dtype=np.int64)
    work = model.whole_seconds(lengths)
    placed = Placed.empty(world)
    ring = tuple(range(16))
    member = float(model.alone_ring_seconds(lengths[:1], np.asarray([16]))[0])
    placed.groups[0] = (ring, (4096,) * 16)
    placed.in_ring[list(ring)] = True
    placed.load[list(ring)] = member
    level = 1.5 * member
    wholes = np.arange(1, 201)
    offsets = forward_offsets(placed, lengths, work, wholes, level, model)
    assert offsets is not None
    room = np.maximum(level - placed.load, 0.0)
    assert (offsets >= 0).all() and (offsets <= room + 1e-12).all()
    whole_forward = model.whole_forward_seconds(lengths[wholes])
    whole_share = float(whole_forward.sum() / work[wholes].sum())
    assert 0.25 < whole_share < 0.4  # the matmuls' forward is a third of their work
    # an empty rank: its whole sequences' forward reaches the level's share at the offset
    share = (level - offsets[-1]) * whole_share / level
    ring_forward = (share * (16 * member + work[wholes].sum()) - whole_forward.sum()) / 16
    assert 0 < ring_forward / member < whole_share  # its members' forward, as costed
    kept = 1 - offsets / room
    assert kept[:16].min() > kept[16:].max()
    assert forward_offsets(placed, lengths, work, np.arange(0), level, model) is None


def test_phase_seconds_add_the_forwards_and_backwards_busiest_ranks() -> None:
    """Whole sequences only: the forward's busiest rank plus the backward's, from the
    work model's whole and forward seconds, at least the busiest rank's work."""
    model = _work_model()
    world = model.cost.topology.world_size
    lengths = np.asarray([8_000, 3_000, 3_000, 500, 500, 500], dtype=np.int64)
    work = model.whole_seconds(lengths)
    forward = model.whole_forward_seconds(lengths)
    placed = Placed.empty(world)
    for seq, rank in enumerate([0, 1, 1, 2, 2, 2]):
        placed.local[seq] = rank
        placed.load[rank] += work[seq]
    ranks = np.asarray([0, 1, 1, 2, 2, 2])
    fwd = np.bincount(ranks, forward, minlength=world)
    expected = fwd.max() + (placed.load - fwd).max()
    assert phase_seconds(placed, lengths, model) == pytest.approx(expected)
    assert phase_seconds(placed, lengths, model) >= placed.busiest
    assert 0.25 < forward.sum() / work.sum() < 0.4  # the forward's share of the work


def test_the_level_placed_again_is_kept_only_no_busier_and_faster_by_phase(monkeypatch) -> None:
    """8 nodes of cluster A, a prolong64k batch whose whole sequences fill ring members
    with forward room: the kept level is placed again with the forward counted, kept
    where its busiest rank is no busier and its phases' busiest ranks add up to less;
    without the tie-break the plan is the first placement's."""
    topology, shape = _cluster(8)
    model = WorkModel.create(shape, topology)
    lengths = batch_lengths("prolong64k", 4096 * topology.world_size, seed=3)
    seen: list[tuple[Placed, float]] = []
    measured = balance_module.phase_seconds

    def spy(placed, lengths, model):
        value = measured(placed, lengths, model)
        seen.append((placed, value))
        return value

    monkeypatch.setattr(balance_module, "phase_seconds", spy)
    out = balance_module.balance(lengths, topology, 5120, model)
    (again, a), (first, b) = seen
    assert a < b and again.busiest <= first.busiest
    locals_out = {p.seq: p.ranks[0] for p in out if p.ring_size == 1}
    assert locals_out == again.local
    monkeypatch.setattr(balance_module, "FORWARD_TIE_BREAK", False)
    seen.clear()
    plain = balance_module.balance(lengths, topology, 5120, model)
    assert not seen
    assert {p.seq: p.ranks[0] for p in plain if p.ring_size == 1} != locals_out
