"""USP groups whose ring positions span two whole nodes (`WorkModel.usp_widths`,
`ray_zep.partition.work.WIDE_SPAN`): Ulysses across the two nodes' GPUs, so each node
attends with half of the heads and imports half of the long sequence's K/V."""

from __future__ import annotations

import pytest

from ray_zep.data.synthetic import batch_lengths
from ray_zep.parallel.axes import Placement
from ray_zep.partition import make_plan, work
from ray_zep.partition.plan import SeqPlacement, bounds_for_counts, local_placement
from ray_zep.partition.usp_grid import positions_in_nodes
from ray_zep.sim.step import simulate_plan
from tests.test_narrow_usp import assert_group_matches_single_device, usp_cluster


@pytest.mark.dist
def test_positions_of_two_nodes_match_single_device() -> None:
    """4 x 2: a sequence on 2 positions of two whole nodes each (ranks 0-3 and 4-7: every
    Ulysses exchange crosses a node boundary), with whole sequences beside it on ranks
    0, 1 and 5; multi-head and grouped-query (the K/V heads fewer than the members),
    direct, routed and with dK/dV sent to their owners: outputs and gradients equal one
    device's, and each rank issues the calls its schedule counts."""
    group = SeqPlacement(0, 61, tuple(range(8)), bounds_for_counts([30, 31]), ulysses=4)
    placements = [group, local_placement(1, 5, 0), local_placement(2, 3, 1),
                  local_placement(3, 9, 5)]  # fmt: skip
    assert_group_matches_single_device(placements, nodes=4, gpus=2, capacity=20)


@pytest.mark.unit
def test_positions_span_two_nodes_only_where_their_gpus_split_the_heads() -> None:
    """7B (32 heads) on 8-GPU nodes may take positions of 16 GPUs; 13B (40 heads) may not;
    positions of whole nodes are recognised, positions that cut a node are not."""
    for preset, wide in (("7b", True), ("13b", False)):
        widths = usp_cluster(4, preset)[2].usp_widths()
        assert (16 in widths) is wide and max(widths) <= 16, (preset, widths)
    assert positions_in_nodes(tuple(range(8, 24)) + tuple(range(0, 8)) + tuple(range(24, 32)),
                              16, 8)  # fmt: skip
    assert not positions_in_nodes(tuple(range(4, 20)), 16, 8)


@pytest.mark.unit
def test_the_work_policy_runs_the_longest_chat_document_on_two_node_positions() -> None:
    """`bench scale`'s 7b chat batch on 256 GPUs (4k tokens per GPU): its 242k-token
    document's ring of one-node positions is bound by the K/V every node imports; on
    positions of two nodes each node imports half of it. The work policy takes such a
    group (every position two whole nodes), and the simulated step is shorter than with
    one-node positions only."""
    topology, run, _ = usp_cluster(32)
    lengths = batch_lengths("chat", 4096 * 256, 0)
    plan = make_plan(Placement.ZEPPELIN, lengths, topology, 5120, run.shape)
    longest = plan.placements[int(lengths.argmax())]
    assert longest.ulysses == 16, longest.ulysses
    wide = [p for p in plan.placements if p.ulysses > topology.gpus_per_node]
    for p in wide:
        assert p.ulysses == 16 and positions_in_nodes(p.ranks, p.ulysses, topology.gpus_per_node)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(work, "WIDE_SPAN", 1)
        narrow = make_plan(Placement.ZEPPELIN, lengths, topology, 5120, run.shape)
    assert all(p.ulysses <= topology.gpus_per_node for p in narrow.placements)
    step, before = (simulate_plan(p, run, True, None).step_seconds for p in (plan, narrow))
    assert step < 0.95 * before, (step, before)
