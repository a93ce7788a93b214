"""Why a rank's compute lane stands idle: its transfers or waits (`ray_zep.sim.idle`)."""

from __future__ import annotations

import pytest

from ray_zep.sim.events import Lane, TaskGraph, simulate
from ray_zep.sim.idle import TRANSFERS, WAITS, idle_causes


def _compute(graph: TaskGraph, rank: int, seconds: float, deps=()) -> int:
    return graph.add("compute", rank, Lane.COMPUTE, seconds, (("compute", rank),), deps)


def _message(graph: TaskGraph, src: int, dst: int, seconds: float, deps=()) -> int:
    return graph.add("K/V", src, Lane.INTER_NODE, seconds, (("out", src), ("in", dst)), deps)


def test_a_gap_splits_into_the_peer_it_waited_for_and_the_message_that_followed() -> None:
    # rank 1 computes 3 s, then sends 2 s to rank 0, which computed 1 s and waits for it
    graph = TaskGraph()
    mine = _compute(graph, 0, 1.0)
    peer = _compute(graph, 1, 3.0)
    sent = _message(graph, 1, 0, 2.0, [peer])
    _compute(graph, 0, 1.0, [graph.join(0, [mine, sent])])
    timeline = simulate(graph)
    causes = idle_causes(timeline, 0)
    # idle 1..5 s: waiting for rank 1's compute until 3 s, then its message until 5 s
    assert causes == pytest.approx({WAITS: 2.0, TRANSFERS: 2.0})
    busy = timeline.busy(0, Lane.COMPUTE)
    assert sum(causes.values()) == pytest.approx(timeline.makespan - busy)


def test_a_message_sharing_its_link_with_another_is_a_transfer() -> None:
    # two 1 s messages share rank 1's outgoing link, each at half its bandwidth; rank 0
    # needs the second one
    graph = TaskGraph()
    first = graph.add("other", 1, Lane.INTER_NODE, 1.0, (("out", 1), ("in", 2)))
    needed = _message(graph, 1, 0, 1.0)
    _compute(graph, 0, 0.5, [needed])
    timeline = simulate(graph)
    assert timeline.end[first] == timeline.end[needed] == pytest.approx(2.0)
    assert idle_causes(timeline, 0) == pytest.approx({TRANSFERS: 2.0, WAITS: 0.0})


def test_after_its_last_task_a_rank_waits_for_the_slowest() -> None:
    graph = TaskGraph()
    _compute(graph, 0, 1.0)
    _compute(graph, 1, 4.0)
    timeline = simulate(graph)
    assert idle_causes(timeline, 0) == pytest.approx({TRANSFERS: 0.0, WAITS: 3.0})
    assert idle_causes(timeline, 1) == pytest.approx({TRANSFERS: 0.0, WAITS: 0.0})


def test_a_rank_s_own_last_message_after_its_compute_is_a_transfer() -> None:
    graph = TaskGraph()
    done = _compute(graph, 0, 1.0)
    _message(graph, 0, 1, 2.0, [done])
    timeline = simulate(graph)
    assert idle_causes(timeline, 0) == pytest.approx({TRANSFERS: 2.0, WAITS: 0.0})
