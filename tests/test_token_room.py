"""More token room for the same batches (`ray_zep.sim.token_room`) and `plan --auto`'s pass
over it."""

from __future__ import annotations

import numpy as np
import pytest

from ray_zep.config import load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.sim.token_room import (
    ROOM_FACTORS,
    ROOM_HALVINGS,
    ROOM_MOST,
    ROOM_STEP,
    next_room,
    with_room,
)
from tests.helpers.scenarios import WHOLE_EXCHANGES

pytestmark = pytest.mark.unit

BUDGET = ["parallel.sequence=zeppelin", "data.packing=budget", "data.batch_fill=0.8"]


def _budget(config) -> int:
    from ray_zep.config import batch_budget
    from ray_zep.topology import build_topology

    world = build_topology(config.topology).world_size
    return batch_budget(config.data.batch_fill, world, config.train.tokens_per_rank)


@pytest.mark.parametrize("factor", [1.25, 1.5, 1.37])
def test_more_room_keeps_the_batch_budget_and_draws_the_same_batches(factor: float) -> None:
    """L rises by the factor (rounded up), the fill falls so that the batch budget is the
    same token for token, and the data actor draws the same batches from the same data;
    rank-packed batches (bins of L tokens) get no room, since a larger L is another batch."""
    from ray_zep.sim.replay import data_batches

    config = load_config(None, ["topology.nodes=2", "topology.gpus_per_node=2",
                                "train.tokens_per_rank=1000", "data.source=synthetic:github",
                                "data.length_scale=0.01", *BUDGET])  # fmt: skip
    roomy = with_room(config, factor, 4)
    assert roomy.train.tokens_per_rank == int(np.ceil(1000 * factor))
    assert roomy.data.batch_fill < config.data.batch_fill
    assert _budget(roomy) == _budget(config) == 3200
    before, after = data_batches(config, 4, 0, 3), data_batches(roomy, 4, 0, 3)
    for (a, _), (b, _) in zip(before, after, strict=True):
        assert np.array_equal(a, b)
    ranked = load_config(None, ["train.tokens_per_rank=1000"])  # whole sequences, rank bins
    assert with_room(ranked, factor, 4) is None


def test_the_room_is_searched_next_to_the_fastest_on_the_ladder() -> None:
    assert ROOM_FACTORS[-1] == ROOM_MOST == 2.0  # the most is always played
    assert next_room([1.0, 1.25, 1.5], fastest=1.5) == 1.75
    assert next_room([1.0, 1.25, 1.5, 1.75], fastest=1.75) == ROOM_MOST
    assert next_room([1.0, 1.9], fastest=1.9) == 2.0  # never past the most
    assert next_room([1.0, 1.25, 1.5, 2.0], fastest=2.0) == 1.75  # the gap under the most
    assert next_room([1.0, 1.25, 1.5, 2.0], fastest=1.5) == 1.75  # and over the fastest
    assert next_room([1.0, 1.5, 1.75], fastest=1.5) == 1.25  # below, once above is played


def test_once_the_ladder_is_played_the_gaps_beside_the_fastest_are_halved() -> None:
    """Both ladder neighbours played: the middle to the nearest played factor above, then
    below, while that gap is wider than a step / 2^ROOM_HALVINGS; never under the smallest
    played nor past the most; a factor of the ladder is not played again from a middle."""
    finest = ROOM_STEP / 2**ROOM_HALVINGS
    assert ROOM_HALVINGS == 2 and finest == 0.0625
    assert next_room([1.0, 1.25, 1.5], fastest=1.25) == 1.375
    assert next_room([1.0, 1.25, 1.5, 1.375], fastest=1.25) == 1.3125
    assert next_room([1.0, 1.25, 1.5, 1.375, 1.3125], fastest=1.25) == 1.125
    assert next_room([1.0, 1.25, 1.5, 1.375, 1.3125, 1.125], fastest=1.25) == 1.1875
    assert next_room([1.0, 1.25, 1.5, 1.375, 1.3125, 1.125, 1.1875], fastest=1.25) is None
    # a middle that wins: its own gaps are halved, the ladder's steps from it are not played
    played = [1.0, 1.25, 1.5, 1.75, 2.0, 1.875, 1.8125, 1.625]
    assert next_room(played, fastest=1.625) == 1.6875
    assert next_room([*played, 1.6875], fastest=1.625) == 1.5625
    assert next_room([*played, 1.6875, 1.5625], fastest=1.625) is None
    # the most played and fastest: only the gap below it
    assert next_room([1.0, 1.25, 1.5, 1.75, 2.0], fastest=2.0) == 1.875
    assert next_room([1.5, 1.75], fastest=1.5) == 1.625  # never under the smallest played
    assert next_room([1.5, 1.625, 1.75], fastest=1.5) == 1.5625
    assert next_room([1.5, 1.5625, 1.625, 1.75], fastest=1.5) is None
    assert next_room([1.0, 1.25, 1.5], fastest=1.25, halvings=0) is None  # the ladder alone


def test_plan_auto_plays_the_fastest_composition_with_more_room_and_keeps_it_where_faster(
    tmp_path,
) -> None:
    """256 GPUs of cluster A, 7B, github at 4k tokens per GPU with L = 1.25 x that: the
    documents of 8k-50k tokens fill their ranks' tokens at half the mean work. The fastest
    composition played again with L x 1.25, 1.5 and 2 for the same batch steps faster with
    the room (3.68 s against 3.46, 3.38 and 3.36 s); x 2 won, so x 1.75 next to it is
    played too, and loses (3.48 s); then the gaps beside the fastest are halved: x 1.875
    wins (3.356 s), x 1.9375 and 1.8125 lose. L x 1.875 wins, and its YAML holds that L and
    the same batch budget."""
    from ray_zep.sim.auto import AutoPlan, _roomier, evaluate_group, write_best
    from ray_zep.sim.request import SimulateRequest, batches_of, request_hardware

    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=32",
                                "model.preset=7b", "train.tokens_per_rank=5120",
                                "parallel.weights=fsdp", "parallel.routing=true",
                                *BUDGET, WHOLE_EXCHANGES])  # fmt: skip
    hardware, on_gpu = request_hardware(config, None)
    request = SimulateRequest(None, False, 1, "github", tokens=4096 * 256)
    batches = [(b, None) for b in batches_of(config, hardware.topology, request)[0]]
    searched = evaluate_group([config], hardware, batches, on_gpu)
    drawn = []

    def batches_for(candidate):
        drawn.append(candidate)
        return batches

    roomier = _roomier(AutoPlan(searched), config, hardware, batches_for, on_gpu)
    assert [c.config.train.tokens_per_rank for c in roomier] == [6400, 7680, 10240, 8960, 9600,
                                                                 9920, 9280]  # fmt: skip
    assert all(c.room_of is searched[0] and c.fits and _budget(c.config) == _budget(config)
               for c in roomier)  # fmt: skip
    assert [c.config for c in roomier] == drawn
    assert min(c.step_seconds for c in roomier) < 0.95 * searched[0].step_seconds
    plan = AutoPlan(searched + roomier)
    assert plan.best.room_of is not None and plan.best.name.endswith("+L=9600"), plan.best.name
    assert "with L = 9600 rather than 5120 for the same batches it steps 0.9" in plan.why()
    chosen = load_config(write_best(plan, tmp_path / "best.yaml"), [])
    assert chosen.train.tokens_per_rank == 9600 and _budget(chosen) == _budget(config)


def test_a_batch_fill_below_one_leaves_whole_sequence_compositions_in_the_search() -> None:
    """Whole sequences train rank-packed batches, which fill each rank's L: their
    compositions take a fill of 1 (the config's own checks refuse a lower one with rank
    packing) instead of stopping the whole search."""
    from ray_zep.sim.auto import compositions

    config = load_config(None, ["topology.nodes=1", "topology.gpus_per_node=4", *BUDGET])
    every = compositions(config, 4)
    whole = [c for c in every if c.parallel.sequence.value == "whole"]
    split = [c for c in every if c.parallel.sequence.value == "zeppelin"]
    assert whole and all(c.data.packing.value == "rank" and c.data.batch_fill == 1 for c in whole)
    assert split and all(c.data.batch_fill == 0.8 for c in split)


def test_plan_summary_counts_the_token_bound_ranks() -> None:
    """256 GPUs of cluster A, 7B, 4k tokens per GPU, L = 5,120: on github some ranks hold
    nearly L at half the mean work (8k-50k-token documents: ranks for their tokens), and
    `ray-zep plan`'s summary line says how many and what may help; arxiv has none."""
    from ray_zep.report.placement import token_bound_ranks
    from tests.helpers.summaries import summaries

    counts = {}
    for data, (plan, stats, line) in summaries(BUDGET, ("github", "arxiv")).items():
        counts[data] = token_bound_ranks(plan, stats)
        assert ("at under 0.8x the mean work" in line) == (counts[data] > 0), line
    light = counts["github"]
    assert 20 <= light <= 128 and counts["arxiv"] == 0, counts


def test_plan_auto_plays_the_fastest_composition_with_no_kv_room_held_and_keeps_it_where_faster(
    tmp_path,
) -> None:
    """64 GPUs of cluster A, 13B, the chat mix at 4k tokens per GPU with L = 7,680 (`bench
    scale`'s row): the fastest composition, whose planner holds a kept ring's room free on
    its members, played again with `parallel.ring_kv_room_mb=0` (members filled,
    `keep_where_room` keeping where room is left) steps faster, wins, and its YAML holds
    the 0; a composition whose K/V room is set, or whose planner does not read it, is not
    played again."""
    from ray_zep.sim.auto import AutoPlan, evaluate_group, kv_room_zero, write_best
    from ray_zep.sim.compare import variant_config
    from ray_zep.sim.request import request_hardware

    base = load_config(None, ["topology.preset=cluster_a", "topology.nodes=8", "model.preset=13b",
                              "train.tokens_per_rank=7680", "parallel.weights=fsdp"])  # fmt: skip
    config = variant_config(base, "zeppelin", 7680)
    hardware, on_gpu = request_hardware(config, None)
    batches = [(batch_lengths("chat", 4096 * 64, 0), None)]
    searched = evaluate_group([config], hardware, batches, on_gpu)
    (zero,) = kv_room_zero(AutoPlan(searched), config, hardware, lambda _: batches, on_gpu)
    assert zero.config.parallel.ring_kv_room_mb == 0.0 and zero.fits
    assert zero.step_seconds < 0.99 * searched[0].step_seconds
    plan = AutoPlan([*searched, zero])
    assert plan.best is zero and "+ring_kv_room_mb=0" in plan.best.name, plan.best.name
    chosen = load_config(write_best(plan, tmp_path / "best.yaml"), [])
    assert chosen.parallel.ring_kv_room_mb == 0.0
    assert kv_room_zero(AutoPlan([zero]), config, hardware, lambda _: batches, on_gpu) == []
    te = evaluate_group([variant_config(base, "te_cp", 7680)], hardware, batches, on_gpu)
    assert kv_room_zero(AutoPlan(te), config, hardware, lambda _: batches, on_gpu) == []
