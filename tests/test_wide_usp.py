"""USP groups whose ring positions span several whole nodes (`WorkModel.usp_widths`, up to
`ray_zep.partition.work.WIDE_SPAN`): Ulysses across the s nodes' GPUs, so each node
attends with 1 / s of the heads and imports 1 / s of the long sequence's K/V."""

from __future__ import annotations

import numpy as np
import pytest

from ray_zep.config import load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.parallel.axes import Placement
from ray_zep.partition import make_plan, work
from ray_zep.partition.plan import SeqPlacement, bounds_for_counts, local_placement
from ray_zep.partition.plan_memory import planning_parallel
from ray_zep.partition.usp_grid import UspGrid, positions_in_nodes
from ray_zep.partition.work import FORWARD_SHARE, WorkModel
from ray_zep.sim.compare import variant_config
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel, simulate_plan
from ray_zep.topology import build_topology
from tests.test_narrow_usp import assert_group_matches_single_device, usp_cluster


@pytest.mark.dist
def test_positions_of_two_nodes_match_single_device() -> None:
    """4 x 2: a sequence on 2 positions of two whole nodes each (ranks 0-3 and 4-7: every
    Ulysses exchange crosses a node boundary), a 9-token guest in the same item
    (`ray_zep.partition.wide_guests`), whole sequences beside them on ranks 0 and 1;
    multi-head and grouped-query (the K/V heads fewer than the members), direct, routed
    and with dK/dV sent to their owners: outputs and gradients equal one device's, and
    each rank issues the calls its schedule counts."""
    ranks = tuple(range(8))
    group = SeqPlacement(0, 61, ranks, bounds_for_counts([30, 31]), ulysses=4)
    guest = SeqPlacement(3, 9, ranks, bounds_for_counts([4, 5]), ulysses=4)
    placements = [group, local_placement(1, 5, 0), local_placement(2, 3, 1), guest]
    assert_group_matches_single_device(placements, nodes=4, gpus=2, capacity=20)


@pytest.mark.dist
def test_positions_of_three_nodes_match_single_device() -> None:
    """6 x 2: a sequence on 2 positions of three whole nodes each (ranks 0-5 and 6-11: a
    member's Ulysses peers on its own node and two others), whole sequences beside it on
    ranks 0, 1 and 7; 12 heads, as many and 2 K/V heads, direct, routed and with dK/dV
    sent to their owners: outputs and gradients equal one device's, and each rank issues
    the calls its schedule counts."""
    group = SeqPlacement(0, 61, tuple(range(12)), bounds_for_counts([30, 31]), ulysses=6)
    placements = [group, local_placement(1, 5, 0), local_placement(2, 3, 1),
                  local_placement(3, 9, 7)]  # fmt: skip
    assert_group_matches_single_device(placements, nodes=6, gpus=2, capacity=20, heads=12)


@pytest.mark.unit
def test_positions_span_whole_nodes_only_where_their_gpus_split_the_heads() -> None:
    """On 8-GPU nodes 7B (32 heads) may take positions of two and four nodes (16 and 32
    GPUs), 13B (40 heads) of five (40 GPUs) and no fewer, none wider than `WIDE_SPAN`
    nodes nor than the cluster; positions of whole nodes are recognised, positions that
    cut a node are not."""
    for preset, nodes, wide in (("7b", 8, (16, 32)), ("13b", 8, (40,)), ("13b", 4, ())):
        widths = usp_cluster(nodes, preset)[2].usp_widths()
        assert tuple(u for u in widths if u > 8) == wide, (preset, nodes, widths)
        assert max(widths) <= 8 * work.WIDE_SPAN
    assert positions_in_nodes(tuple(range(8, 24)) + tuple(range(0, 8)) + tuple(range(24, 32)),
                              16, 8)  # fmt: skip
    assert not positions_in_nodes(tuple(range(4, 20)), 16, 8)


@pytest.mark.unit
def test_the_work_policy_runs_the_longest_chat_document_on_positions_of_several_nodes() -> None:
    """`bench scale`'s 7b chat batch on 256 GPUs (4k tokens per GPU): its 242k-token
    document's ring of one-node positions is bound by the K/V every node imports; on
    positions of s nodes each node imports 1 / s of it. The work policy takes such a
    group (every position whole nodes), and the simulated step is shorter than with
    one-node positions only."""
    topology, run, _ = usp_cluster(32)
    gpus = topology.gpus_per_node
    lengths = batch_lengths("chat", 4096 * 256, 0)
    plan = make_plan(Placement.ZEPPELIN, lengths, topology, 5120, run.shape)
    longest = plan.placements[int(lengths.argmax())]
    assert longest.ulysses > gpus, longest.ulysses
    for p in plan.placements:
        if p.ulysses > gpus:
            assert p.ulysses in (16, 32) and positions_in_nodes(p.ranks, p.ulysses, gpus)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(work, "WIDE_SPAN", 1)
        narrow = make_plan(Placement.ZEPPELIN, lengths, topology, 5120, run.shape)
    assert all(p.ulysses <= topology.gpus_per_node for p in narrow.placements)
    step, before = (simulate_plan(p, run, True, None).step_seconds for p in (plan, narrow))
    assert step < 0.95 * before, (step, before)


@pytest.mark.unit
def test_a_one_node_group_bound_on_its_hops_gives_way_to_wider_positions() -> None:
    """`bench scale`'s 13b github batch on 1,024 GPUs (L = 7,680) holds a 242k-token
    document; its ring members keep their peers' K/V for the backward where the memory
    left beside full activation checkpointing allows, as the bench plans it. As 14
    one-node positions (112 ranks) its member work is within a level, but its forward,
    waiting on the K/V every node imports, passes `FORWARD_SHARE` of it and would set the
    step's forward; the grid takes 3 positions of five nodes (120 ranks) instead, within
    the level in both. Where the level leaves its forward room, the one-node group
    stays."""
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=128",
                                "model.preset=13b", "parallel.weights=fsdp",
                                "train.tokens_per_rank=7680",
                                "train.activation_checkpointing=full"])  # fmt: skip
    config = variant_config(config, "zeppelin", 7680)
    topology = build_topology(config.topology)
    run = RunModel.create(config, Hardware.preset(topology))
    parallel = planning_parallel(config, topology, run.shape)
    model = WorkModel.create(run.shape, topology, routed=parallel.routing,
                             dkv_wire=parallel.dkv_wire, keep_kv_gb=parallel.ring_kv_keep_gb,
                             room_mb=parallel.ring_kv_room_mb, capacity=7680)  # fmt: skip
    n = 242302
    grid = UspGrid.of(np.asarray([n]), np.asarray([True]), 7680, topology, model)
    one_node = (grid.widths == 8) & (grid.positions == 14)
    level = float(grid.seconds[0, one_node][0]) * 1.001
    assert float(grid.forward[0, one_node][0]) > FORWARD_SHARE * level
    fewest = grid.degrees[(grid.seconds[0] <= level)].min()
    assert fewest == 112  # without the forward's check, the one-node group would win
    seqs, ring = np.asarray([0]), np.asarray([n // 7680 + 1])
    degree, member, width = grid.choose(seqs, ring, np.asarray([np.inf]), level)
    assert (degree[0], width[0]) == (120, 40), (degree, width)
    column = (grid.widths == 40) & (grid.positions == 3)
    assert member[0] <= level and float(grid.forward[0, column][0]) <= FORWARD_SHARE * level
    roomy = 1.5 * level
    degree, _, width = grid.choose(seqs, ring, np.asarray([np.inf]), roomy)
    assert width[0] == 8, (degree, width)
