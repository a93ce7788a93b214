"""Small rings on ranks of one node that already share a ring (`ray_zep.partition.co_rings`):
where a level's rings hold the ranks with work room, a whole sequence that fits on no
rank whole runs as a second ring over some of them, the engine runs it as one device
would, and the work policy's step gets shorter for it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

import ray_zep.partition.level_fill as level_fill
import ray_zep.partition.wide_guests as wide_guests
from ray_zep.config import load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.parallel.axes import Placement
from ray_zep.partition.co_rings import FREE, SEVERAL, RingLabels, co_member_ring
from ray_zep.partition.level_trace import LevelOutcome
from ray_zep.partition.plan import AttentionPlan, SeqPlacement, bounds_for_counts, local_placement
from ray_zep.sim.compare import variant_config
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel, plan_batch, simulate_plan
from ray_zep.topology import build_topology
from tests.helpers.ring_search import ring_search_cases
from tests.helpers.scenarios import WHOLE_EXCHANGES
from tests.test_narrow_usp import assert_group_matches_single_device


@pytest.mark.dist
def test_a_ring_over_members_of_a_usp_group_matches_single_device() -> None:
    """2 x 4: a 61-token sequence on 2 positions of a whole node each, and a 9-token
    sequence as a second ring over two of node 0's members (the engine runs it after
    the group), whole sequences on ranks 0 and 5; multi-head and grouped-query, direct,
    routed and with dK/dV sent to their owners: outputs and gradients equal one
    device's, and each rank issues the calls its schedule counts."""
    group = SeqPlacement(0, 61, tuple(range(8)), bounds_for_counts([30, 31]), ulysses=4)
    second = SeqPlacement(3, 9, (1, 2), bounds_for_counts([4, 5]))
    placements = [group, local_placement(1, 5, 0), local_placement(2, 3, 5), second]
    topology = load_config(None, ["topology.nodes=2", "topology.gpus_per_node=4"]).topology
    plan = AttentionPlan(Placement.ZEPPELIN, build_topology(topology), 20, tuple(placements))
    assert [item.ranks for item in plan.items() if item.ring_size > 1] == [tuple(range(8)), (1, 2)]
    assert_group_matches_single_device(placements, nodes=2, gpus=4, capacity=20)


@pytest.mark.unit
def test_labels_name_each_ranks_one_ring() -> None:
    """Two nodes of 4: sequences on the same ranks share a label, a rank in two rings is
    `SEVERAL`, a rank in none `FREE`; a group added later is counted by the next call."""
    groups = {0: ((0, 1, 2, 3, 4, 5), (1,) * 6), 1: ((0, 1, 2, 3, 4, 5), (1,) * 6)}
    labels = RingLabels(groups, 8, 4)
    first = labels.now().copy()
    assert (first[:6] == first[0]).all() and first[0] >= 0
    assert (first[6:] == FREE).all()
    groups[2] = ((4, 6), (1, 1))
    now = labels.now()
    assert now[4] == SEVERAL and now[6] >= 0 and now[6] != now[0] and now[7] == FREE


@pytest.mark.unit
def test_a_second_ring_takes_the_fewest_members_of_one_ring_with_room() -> None:
    """Node 0 holds one ring, node 1 two: the ring over 7 tokens goes to the fewest
    ranks of one node in one same ring whose work and token room take a member, the
    least loaded first; none where no two such ranks have room."""
    groups = {0: ((0, 1, 2, 3), (4,) * 4), 1: ((4, 5), (4, 4)), 2: ((6, 7), (4, 4))}
    labels = RingLabels(groups, 8, 4)
    load = np.asarray([0.9, 0.5, 0.6, 0.55, 0.5, 0.95, 0.4, 0.45])
    tokens = np.full(8, 6)
    member = np.asarray([0.3, 0.2, 0.15])  # rings of 2, 3 and 4 members
    # 7 tokens: 4 a member of 2 (room 10 - 6), so two of ranks 1-3 or 6-7
    ring, seconds = co_member_ring(labels, load, tokens, 7, member, 1.0, 10)
    assert ring == (6, 7) and seconds == 0.3
    # 10 tokens: 5 a member of 2 -> no room; 4 for 3 -> ranks 1-3 (ranks 6-7 are two)
    ring, seconds = co_member_ring(labels, load, tokens, 10, member, 1.0, 10)
    assert ring == (1, 2, 3) and seconds == 0.2
    assert co_member_ring(labels, load, tokens, 10, member, 0.7, 10) is None  # no work room
    assert co_member_ring(labels, load, tokens, 20, member, 1.0, 10) is None  # no token room


def _scan_co_member_ring(rings, load, tokens, n, member, level, capacity, gpus):
    """The fewest ranks of one node in one same ring, size by size and rank by rank: the
    least loaded rank (the lowest on ties) among those whose ring has enough fitting ranks
    on its node, then that ring's least loaded fitting ranks there (the lowest on ties)."""
    for k, degree in enumerate(range(2, gpus + 1)):
        need = -(-n // degree)
        fitting = [r for r in range(len(load)) if len(rings[r]) == 1
                   and capacity - tokens[r] >= need and load[r] + member[k] <= level]  # fmt: skip
        peers = {r: [q for q in fitting if q // gpus == r // gpus and rings[q] == rings[r]]
                 for r in fitting}  # fmt: skip
        fits = [r for r in fitting if len(peers[r]) >= degree]
        if fits:
            first = min(fits, key=lambda r: (load[r], r))
            chosen = sorted(peers[first], key=lambda r: (load[r], r))[:degree]
            return tuple(sorted(chosen)), float(member[k])
    return None


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(**ring_search_cases([(), (0,), (1,), (2,), (0, 1)]))
def test_the_search_takes_the_ranks_a_scan_of_every_rank_takes(
    cells, gpus, n, member, level
) -> None:
    """Loads, member work and the level in whole numbers (every sum exact), ranks in no
    ring, in one of three and in two: `co_member_ring` agrees with a scan to the last tie,
    and labels each rank as its rings say."""
    cells = cells[: len(cells) // gpus * gpus]
    load = np.asarray([float(c[0]) for c in cells])
    tokens = np.asarray([c[1] for c in cells], dtype=np.int64)
    rings = [c[2] for c in cells]
    groups = {}
    for ring in range(3):
        members = tuple(r for r in range(len(cells)) if ring in rings[r])
        if members:
            groups[ring] = (members, (1,) * len(members))
    labels = RingLabels(groups, len(cells), gpus)
    # a rank's rings: the distinct groups of ranks it is in (two sequences on the same
    # ranks are one ring)
    rings = [{ranks for ranks, _ in groups.values() if r in ranks} for r in range(len(cells))]
    now = labels.now()
    assert [int(x) == FREE for x in now] == [not ring for ring in rings]
    assert [int(x) == SEVERAL for x in now] == [len(ring) > 1 for ring in rings]
    member = np.asarray(member[: gpus - 1], dtype=np.float64)  # any order over the sizes
    got = co_member_ring(labels, load, tokens, n, member, float(level), 8)
    assert got == _scan_co_member_ring(rings, load, tokens, n, member, level, 8, gpus)


@pytest.mark.unit
def test_whole_sequences_ride_as_second_rings_where_the_rings_hold_the_room() -> None:
    """`bench scale`'s chat batch on 256 GPUs of cluster A, 13b, 4k tokens per GPU
    (L = 7,680): at the lowest level the groups' members hold the work room and the
    other ranks the token room, so whole sequences of a few thousand tokens fit no rank
    whole. As second rings over members of one group inside a node they keep that level
    (busiest rank 1.10x the mean rank's work, against 1.12x without, where the planner
    kept level 1.10), no rank holds more than L, and the simulator plays a shorter step
    (4.492 s against 4.553 s; groups of five-node positions kept from hosting guests,
    `ray_zep.partition.wide_guests`, with which the step is 4.486 s against 4.524 s)."""
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=32",
                                "model.preset=13b", "parallel.weights=fsdp",
                                WHOLE_EXCHANGES])  # fmt: skip
    config = variant_config(config, "zeppelin", 7680)  # as `bench scale` runs it
    hardware = Hardware.preset(build_topology(config.topology))
    run = RunModel.create(config, hardware)
    lengths = batch_lengths("chat", 4096 * hardware.devices, seed=0)
    gpus = hardware.topology.gpus_per_node
    plans, steps = {}, {}
    for second in (False, True):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(wide_guests, "WIDE_HOSTS", False)  # as the figures were taken
            if not second:
                patch.setattr(level_fill, "SECOND_RINGS", False)
            plan, remap = plan_batch(lengths, run)
        plans[second] = plan
        steps[second] = simulate_plan(plan, run, run.config.parallel.routing, remap).step_seconds
    plan = plans[True]
    assert plan.rank_tokens().max() <= 7680
    rings = [item for item in plan.items() if item.ring_size > 1]
    inside = [item for item in rings if len({r // gpus for r in item.ranks}) == 1]
    seconds = [item for item in inside
               if any(set(item.ranks) < set(other.ranks) for other in rings)]  # fmt: skip
    assert seconds, "whole sequences must ride as second rings"
    busiest = {k: next(t.busiest for t in p.levels if t.outcome is LevelOutcome.KEPT)
               for k, p in plans.items()}  # fmt: skip
    assert busiest[True] < busiest[False], busiest
    assert steps[True] < 0.99 * steps[False], steps


def _python_ring(placed, labels, seq, n, ranks, member, second, capacity, model) -> None:
    """A small ring placed as the fill placed one in Python before its dealing placed
    them itself: `shared_ring`, `kept_room` (a first ring), the ring label."""
    index = list(ranks)
    placed.load[index] += member
    held = placed.tokens[index] + level_fill.shared_ring(placed, [seq], [n], ranks)
    if second:
        placed.resent.add(ranks)
        placed.tokens[index] = held
    else:
        reserve = level_fill.kept_room(placed, [seq], [n], ranks, int(held.max()), capacity,
                                       model)  # fmt: skip
        placed.tokens[index] = held + reserve
        placed.in_ring[index] = True
    labels.added(ranks)


@pytest.mark.unit
@pytest.mark.parametrize("room_mb", [0.0, 1.0])
def test_the_fill_places_a_small_ring_as_its_python_steps_did(room_mb: float) -> None:
    """Two nodes of 4 holding a ring over ranks 0-3 and one over 4-5: first rings on free
    ranks and second rings on members of one ring (all of its ranks, or some), placed by
    the compiled dealing's step (`fill_kernel._place_ring`), leave the loads, tokens,
    rings, labels and groups the Python steps left, with and without K/V room to keep."""
    from ray_zep.model_shapes import PRESETS
    from ray_zep.partition import fill_kernel
    from ray_zep.partition.work import WorkModel

    topology = build_topology(load_config(None, ["topology.nodes=2",
                                                 "topology.gpus_per_node=4"]).topology)  # fmt: skip
    model = WorkModel.create(PRESETS["7b"], topology, keep_kv_gb=0.001, room_mb=room_mb,
                             capacity=4096)  # fmt: skip
    kept_kv = np.asarray([model.kept_bytes_per_token, model.keep_kv_bytes,
                          model.room_per_token])  # fmt: skip
    rings = [(10, 900, (6, 7), False), (11, 300, (0, 1), True), (12, 700, (4, 5), True),
             (13, 50, (2, 3), True), (14, 40, (0, 2), True)]  # fmt: skip
    python, compiled = (level_fill.Placed.empty(8) for _ in range(2))
    for placed in (python, compiled):
        placed.groups.update({0: ((0, 1, 2, 3), (5, 5, 5, 5)), 1: ((4, 5), (9, 9))})
        placed.load[:6], placed.tokens[:6], placed.in_ring[:6] = 1.0, [5, 5, 5, 5, 9, 9], True
    python_labels = RingLabels(python.groups, 8, 4)
    compiled_labels = RingLabels(compiled.groups, 8, 4, len(rings))
    python_labels.now(), compiled_labels.now()
    state = np.zeros(5, dtype=np.int64)
    records = np.empty((len(rings), fill_kernel.RING_HEAD + 4), dtype=np.int64)
    for position, (seq, n, ranks, second) in enumerate(rings):
        _python_ring(python, python_labels, seq, n, ranks, 0.25, second, 4096, model)
        state[fill_kernel.NEXT_LABEL] = len(compiled_labels.known)
        fill_kernel._place_ring(state, position, np.asarray(ranks), len(ranks) - 2, second, n,
                                0.25, compiled.load, compiled.tokens, compiled.in_ring,
                                compiled_labels.labels, compiled_labels.sizes, records,
                                kept_kv, 4096)  # fmt: skip
        level_fill._add_rings(compiled, records[position : position + 1],
                              np.asarray([seq] * len(rings)), np.asarray([n] * len(rings)),
                              compiled_labels)  # fmt: skip
    assert np.array_equal(python.load, compiled.load)
    assert np.array_equal(python.tokens, compiled.tokens)
    assert np.array_equal(python.in_ring, compiled.in_ring)
    assert python.groups == compiled.groups
    assert python.resent == compiled.resent and python.kept_rings == compiled.kept_rings
    assert np.array_equal(python_labels.labels, compiled_labels.labels)
    assert python_labels.known == compiled_labels.known
    assert (python.kept_rings != set()) == (room_mb > 0)  # the cases hold both kinds
    assert compiled_labels.labels[4] == compiled_labels.labels[5] >= 0  # (4, 5) again: kept
    assert compiled_labels.labels[0] == SEVERAL  # two rings over rank 0


@pytest.mark.unit
@pytest.mark.parametrize("room_mb", [0.0, 0.01, 2.0])
def test_the_compiled_reserve_is_the_work_models(room_mb: float) -> None:
    """`fill_kernel.reserved` answers `WorkModel.reserved_tokens` for whole-GPU members,
    with token room that frees K/V room and without."""
    from ray_zep.model_shapes import PRESETS
    from ray_zep.partition import fill_kernel
    from ray_zep.partition.work import WorkModel

    topology = build_topology(load_config(None, []).topology)
    model = WorkModel.create(PRESETS["13b"], topology, keep_kv_gb=0.5, room_mb=room_mb,
                             capacity=8192)  # fmt: skip
    kept_kv = np.asarray([model.kept_bytes_per_token, model.keep_kv_bytes,
                          model.room_per_token])  # fmt: skip
    for kept in (0, 1, 600, 601, 1000, 12345, 10**6):
        assert fill_kernel.reserved(kept, kept_kv) == model.reserved_tokens(kept)
