"""The work planner's fast paths equal the array scans they replace (hypothesis):
`LoadIndex` best-fit queries, the spill's partial sort, the small ring's node search and
the two-heap whole-sequence deal (`place_whole`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_zep.partition.fill import place_whole
from ray_zep.partition.level_fill import Placed, _small_ring, spill_ranks
from ray_zep.partition.load_index import LoadIndex
from tests.helpers.ring_search import ring_search_cases

pytestmark = pytest.mark.unit


def _fullest_under(load, tokens, bound, room):
    load, tokens = np.asarray(load), np.asarray(tokens)
    ok = (tokens <= bound) & (load <= room)
    return int(np.argmax(np.where(ok, load, -np.inf))) if ok.any() else None


def _least_loaded(load, tokens, bound):
    load, tokens = np.asarray(load), np.asarray(tokens)
    ok = tokens <= bound
    return int(np.argmin(np.where(ok, load, np.inf))) if ok.any() else None


# loads from a few values, so that ties are common
operations = st.lists(
    st.tuples(
        st.sampled_from(["bound", "move", "take", "take_then"]),
        st.integers(0, 11),
        st.integers(0, 6),
        st.integers(0, 30),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=operations, start=st.lists(st.integers(0, 5), min_size=12, max_size=12))
def test_load_index_answers_as_the_array_scan_does(ops, start) -> None:
    load = np.asarray(start, dtype=np.float64)
    tokens = 3 * np.asarray(start, dtype=np.int64)
    index = LoadIndex(load, tokens)
    bound = 10
    index.set_bound(bound)
    for op, rank, amount, limit in ops:
        if op == "bound":  # rises or falls
            bound = limit
            index.set_bound(bound)
        elif op.startswith("take"):  # best fit under `limit`, else the least loaded, in one call
            room = float(limit) / 3 - 3  # below every load at times: the least loaded
            want = _fullest_under(load, tokens, bound, room)
            want = want if want is not None else _least_loaded(load, tokens, bound)
            before = None if want is None else (load[want], tokens[want])
            then = bound + rank % 4 if op == "take_then" else None  # the bound set next
            assert index.take(room, amount, amount, then) == want  # the index adds to the arrays
            if want is not None:
                assert (load[want], tokens[want]) == (before[0] + amount, before[1] + amount)
            if then is not None:
                bound = then
                index.set_bound(bound)
        else:
            load[rank] += amount
            tokens[rank] += amount
            index.move(rank)
        for room in (-1.0, 2.0, 5.5, float(limit), 1e9):
            assert index.fullest_under(room) == _fullest_under(load, tokens, bound, room)
        assert index.least_loaded() == _least_loaded(load, tokens, bound)


@settings(max_examples=200, deadline=None)
@given(
    free=st.lists(st.integers(0, 6), min_size=1, max_size=300),
    share=st.floats(0.0, 1.0),
)
def test_spill_takes_the_ranks_a_full_stable_sort_takes(free, share) -> None:
    capacity = 6
    free = np.asarray(free, dtype=np.int64)
    n = max(1, int(share * free.sum()))
    placed = Placed.empty(free.size)
    placed.tokens[:] = capacity - free
    order = np.argsort(-free, kind="stable")
    count = int(np.searchsorted(np.cumsum(free[order]), n)) + 1
    assert spill_ranks(placed, n, capacity) == tuple(sorted(order[:count].tolist()))


def _scan_small_ring(load, tokens, in_ring, n, member, level, capacity, gpus):
    """The fewest GPUs of one node for a ring over `n` tokens, node by node and size by
    size: of the nodes with enough free ranks, the least loaded in all (the lowest on
    ties); of its free ranks, the least loaded (the lowest GPU on ties)."""
    for k, degree in enumerate(range(2, gpus + 1)):
        need = -(-n // degree)
        best = None
        for node in range(len(load) // gpus):
            ranks = range(node * gpus, (node + 1) * gpus)
            free = [r for r in ranks if not in_ring[r] and capacity - tokens[r] >= need
                    and load[r] + member[k] <= level]  # fmt: skip
            total = float(np.asarray(load[node * gpus : (node + 1) * gpus]).sum())
            if len(free) >= degree and (best is None or total < best[0]):
                best = (total, free)
        if best is not None:
            chosen = sorted(best[1], key=lambda r: (load[r], r))[:degree]
            return tuple(sorted(chosen)), float(member[k])
    return None


@settings(max_examples=200, deadline=None)
@given(**ring_search_cases([False, False, False, True]))
def test_a_small_ring_takes_the_ranks_a_scan_of_every_node_takes(
    cells, gpus, n, member, level
) -> None:
    """Loads, member work and the level in whole numbers: every sum is exact, so the
    search's prefilter over the ranks and the scan agree to the last tie."""
    cells = cells[: len(cells) // gpus * gpus]
    load = [float(c[0]) for c in cells]
    tokens = [c[1] for c in cells]
    in_ring = [c[2] for c in cells]
    member = np.asarray(member[: gpus - 1], dtype=np.float64)  # any order over the sizes
    placed = Placed.empty(len(cells))
    placed.load[:], placed.tokens[:], placed.in_ring[:] = load, tokens, in_ring
    topology = SimpleNamespace(nodes=len(cells) // gpus, gpus_per_node=gpus)
    got = _small_ring(placed, n, member, float(level), 8, topology, None)  # ranks in no ring
    scanned = _scan_small_ring(load, tokens, in_ring, n, member, level, 8, gpus)
    assert got == (None if scanned is None else (*scanned, False))


def _scan_whole(sizes, bins, capacity, by_work):
    free, load, placed = [capacity] * bins, [0.0] * bins, []
    for n in sizes:
        room = [b for b in range(bins) if free[b] >= n]
        if not room:
            return None
        b = min(room, key=lambda b: (load[b] if by_work else -free[b], b))
        free[b] -= n
        load[b] += float(n) * n
        placed.append(b)
    return placed, free, load


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), max_size=40),
    bins=st.integers(1, 9),
    capacity=st.integers(1, 60),
    by_work=st.booleans(),
    longest_first=st.booleans(),
)
def test_whole_sequences_go_where_a_scan_of_every_bin_puts_them(
    sizes, bins, capacity, by_work, longest_first
) -> None:
    if longest_first:
        sizes = sorted(sizes, reverse=True)
    expected = _scan_whole(sizes, bins, capacity, by_work)
    got = place_whole(sizes, bins, capacity, [float(n) * n for n in sizes], by_work)
    if expected is None:
        assert got is None
        return
    assert got[0] == expected[0]
    assert got[1].tolist() == expected[1]
    assert got[2].tolist() == expected[2]


@pytest.mark.parametrize("seed", range(6))
def test_load_index_over_many_blocks_answers_as_the_array_scan_does(seed: int) -> None:
    """Ranks several times a block's (`index_kernel.BLOCK`), so that blocks split, empty
    and leave the order: thousands of random takes, moves and bounds, each answer as the
    array scan's, ties included (loads from few values)."""
    rng = np.random.default_rng(seed)
    world = 700
    load = rng.integers(0, 6, world).astype(np.float64)
    tokens = rng.integers(0, 20, world)
    index = LoadIndex(load, tokens)
    bound = 15
    index.set_bound(bound)
    for _ in range(3000):
        op = rng.integers(0, 5)
        if op == 0:
            bound = int(rng.integers(0, 40))
            index.set_bound(bound)
        elif op <= 2:
            room = float(rng.integers(0, 40)) / 2
            want = _fullest_under(load, tokens, bound, room)
            want = want if want is not None else _least_loaded(load, tokens, bound)
            assert index.take(room, 0.5, int(rng.integers(0, 3))) == want
        else:
            rank = int(rng.integers(0, world))
            load[rank] += float(rng.integers(0, 3))
            tokens[rank] += int(rng.integers(0, 4))
            index.move(rank)
        room = float(rng.integers(0, 40)) / 2
        assert index.fullest_under(room) == _fullest_under(load, tokens, bound, room)
        assert index.least_loaded() == _least_loaded(load, tokens, bound)
