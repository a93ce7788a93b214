"""Messages and collectives share their links (`ray_zep.sim.link_sharing`), in both of the
simulator's schedules: the one-pass schedule and the CPU virtual cluster's, event by
event."""

from __future__ import annotations

import pytest

from ray_zep.sim.events import CorePool, Lane, TaskGraph, simulate

pytestmark = pytest.mark.unit

POOLS = pytest.mark.parametrize("pool", [None, CorePool(2, 1.0)], ids=["one pass", "cores"])


def _flow(graph: TaskGraph, name: str, src: int, dst: int, seconds: float, deps=()) -> int:
    return graph.add(name, src, Lane.INTER_NODE, seconds, (("out", src), ("in", dst)), deps)


def _after(graph: TaskGraph, rank: int, seconds: float) -> int:
    return graph.add("compute", rank, Lane.COMPUTE, seconds, (("compute", rank),))


@POOLS
def test_a_short_message_beside_a_long_one_takes_half_the_link(pool) -> None:
    """A 4 s collective part on rank 1's way out from 0 s, a 1 s message on it from 1 s:
    both move at half pace while both run, so the message ends at 3 s (not 5 s, after
    the whole collective) and the collective 1 s later than alone, at 5 s. The links
    move the same bytes in the same time either way."""
    graph = TaskGraph()
    long = _flow(graph, "gather", 1, 2, 4.0)
    short = _flow(graph, "K/V", 1, 0, 1.0, [_after(graph, 3, 1.0)])
    timeline = simulate(graph, pool)
    assert (timeline.start[short], timeline.end[short]) == pytest.approx((1.0, 3.0))
    assert timeline.end[long] == pytest.approx(5.0)


@POOLS
def test_a_flow_moves_at_the_pace_of_its_busier_link(pool) -> None:
    """Three 1 s messages from 0 s: two out of rank 1 (to 2 and to 0) and one into rank 0
    from rank 3. Rank 1's way out carries two, rank 0's way in two: every message moves at
    half pace, so each ends at 2 s; a message posted after them runs alone."""
    graph = TaskGraph()
    ends = [_flow(graph, "a", 1, 2, 1.0), _flow(graph, "b", 1, 0, 1.0),
            _flow(graph, "c", 3, 0, 1.0)]  # fmt: skip
    late = _flow(graph, "late", 1, 0, 1.0, [graph.add("wait", 1, Lane.HOST, 3.0)])
    timeline = simulate(graph, pool)
    assert [timeline.end[i] for i in ends] == pytest.approx([2.0, 2.0, 2.0])
    assert (timeline.start[late], timeline.end[late]) == pytest.approx((3.0, 4.0))


@POOLS
def test_three_flows_on_one_link_share_it_three_ways(pool) -> None:
    """1 s each on one link, one from 0 s and two from 0.5 s: the first moves alone for
    0.5 s, then each moves at a third until the first ends (2 s), the other two at half
    until 3 s; the link moved 3 s of bytes in 3 s."""
    graph = TaskGraph()
    first = _flow(graph, "first", 1, 2, 1.0)
    posted = graph.add("wait", 1, Lane.HOST, 0.5)
    later = [_flow(graph, "later", 1, 2, 1.0, [posted]) for _ in range(2)]
    timeline = simulate(graph, pool)
    assert timeline.end[first] == pytest.approx(2.0)
    assert [timeline.end[i] for i in later] == pytest.approx([3.0, 3.0])


@POOLS
def test_flows_on_the_same_links_posted_apart_keep_their_own_bytes(pool) -> None:
    """A 2 s flow from rank 1 to 2 from 0 s; from 0.5 s a 1 s flow on the same links and a
    1 s flow from rank 1 to 3 (rank 1's way out only). The first moves alone for 0.5 s,
    then all three at a third: the two later ones end together at 3.5 s, and the first,
    0.5 s left, alone at 4 s. The first flow's end, due at 2 s before the others came,
    moves out to 4 s; the two on the same links end apart, each by its own bytes."""
    graph = TaskGraph()
    first = _flow(graph, "first", 1, 2, 2.0)
    posted = graph.add("wait", 1, Lane.HOST, 0.5)
    same = _flow(graph, "same links", 1, 2, 1.0, [posted])
    other = _flow(graph, "one link", 1, 3, 1.0, [posted])
    timeline = simulate(graph, pool)
    assert [timeline.end[i] for i in (same, other, first)] == pytest.approx([3.5, 3.5, 4.0])


@POOLS
def test_a_batch_of_messages_pays_its_latency_side_by_side_and_its_bytes_in_turn(pool) -> None:
    """Four messages of one batch on one link, each 1 s of bytes after 0.25 s of latency
    (`Task.latency`): the link moves their bytes together, 4 s, and each ends its latency
    later, at 4.25 s (charged on the link, the latency made it 5 s). A message's latency
    beside a lone flow holds no part of the link: the flow ends when its bytes have moved."""
    graph = TaskGraph()
    batch = [graph.add("a2a", 1, Lane.INTER_NODE, 1.25, (("out", 1), ("in", 2)), (), 0.25)
             for _ in range(4)]  # fmt: skip
    other = _flow(graph, "other", 3, 4, 1.0)
    beside = graph.add("a2a", 3, Lane.INTER_NODE, 0.75, (("out", 3), ("in", 5)), (), 0.5)
    timeline = simulate(graph, pool)
    assert [timeline.end[i] for i in batch] == pytest.approx([4.25] * 4)
    # the message's 0.25 s of bytes share rank 3's way out with the flow: both at half
    # pace for 0.5 s, then the flow alone
    assert timeline.end[beside] == pytest.approx(0.5 + 0.5)
    assert timeline.end[other] == pytest.approx(1.25)


def test_a_task_keeps_no_more_latency_than_its_duration() -> None:
    graph = TaskGraph()
    task = graph.add("a2a", 0, Lane.INTER_NODE, 0.1, (("out", 0),), (), 1.0)
    assert graph.tasks[task].latency == pytest.approx(0.1)
