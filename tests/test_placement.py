"""Ranks must run where the topology puts them (rank r on node r // G, in GPU order).

Unit cases of `check_placement`. A real placement by Ray Train is in
tests/test_ray_train.py: two workers per Ray node train with ranks 0, 1 on one node,
2, 3 on the next and 4, 5 on the third; a topology node that no Ray node has room for is
refused there by the driver before any worker starts (`check_node_room`), so `check_placement`
meets a split node only where Ray splits one it had room for (other work on the machines).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_zep.config import load_config
from ray_zep.distributed.placement import WorkerPlace, check_placement, whole_node_ranks
from ray_zep.errors import TopologyError
from ray_zep.topology import build_topology

REPO = Path(__file__).resolve().parents[1]
TWO_BY_TWO = build_topology(
    load_config(None, ["topology.nodes=2", "topology.gpus_per_node=2"]).topology
)


def _places(machines: str, indices: list[int]) -> list[WorkerPlace]:
    return [WorkerPlace(m, i) for m, i in zip(machines, indices, strict=True)]


@pytest.mark.unit
@pytest.mark.parametrize(
    "machines,indices",
    [("AABB", [0, 1, 0, 1]), ("AAAA", [0, 1, 2, 3])],
    ids=["one-node-per-machine", "virtual-on-one-machine"],
)
def test_placements_that_keep_each_node_on_one_machine_pass(machines, indices) -> None:
    check_placement(_places(machines, indices), TWO_BY_TWO)


@pytest.mark.unit
def test_alternating_machines_split_every_node_and_are_refused() -> None:
    with pytest.raises(TopologyError, match="topology node 0"):
        check_placement(_places("ABAB", [0, 0, 1, 1]), TWO_BY_TWO)


@pytest.mark.unit
def test_three_workers_on_one_machine_split_a_node_and_are_refused() -> None:
    with pytest.raises(TopologyError, match=r"topology node 1 \(ranks 2\.\.3.*spans 2 machines"):
        check_placement(_places("AAAB", [0, 1, 2, 0]), TWO_BY_TWO)


@pytest.mark.unit
def test_ranks_must_follow_the_gpu_order_of_their_machine() -> None:
    with pytest.raises(TopologyError, match=r"local indices \[1, 0\]"):
        check_placement(_places("AABB", [1, 0, 0, 1]), TWO_BY_TWO)


@pytest.mark.unit
@pytest.mark.parametrize(
    "machines,most,chosen",
    [
        ("AABBCC", 3, [0, 1, 2, 3, 4, 5]),
        ("AABBC", 3, [0, 1, 2, 3]),  # C holds part of a node: its worker idles
        ("ABBCC", 3, [1, 2, 3, 4]),  # so does A's, even as rank 0
        ("AAAABB", 2, [0, 1, 2, 3]),  # two nodes on one machine; no more than `most`
        ("AAAB", 2, [0, 1]),
    ],
)
def test_an_elastic_group_trains_on_its_whole_nodes(machines, most, chosen) -> None:
    places = _places(machines, [machines[:i].count(m) for i, m in enumerate(machines)])
    assert whole_node_ranks(places, 2, most) == chosen
    topology = TWO_BY_TWO.with_nodes(len(chosen) // 2)
    check_placement([places[r] for r in chosen], topology)
