"""A placement defined outside the package, as a contributor would add one: from this
file alone, a ring whose members hold contiguous chunks plans, simulates and trains
like one process.

The placement is registered while each test runs, and by `_train_all` in the ranks'
processes, so the tests that walk every placement never meet it. Tolerances as in
test_strategies (fp32, AdamW steps compared at 1e-5 relative error).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest

from ray_zep.config import load_config
from ray_zep.errors import PlacementError
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import Placement, declare_placement
from ray_zep.partition import make_plan
from ray_zep.partition.fill import check_total, water_fill
from ray_zep.partition.layout import LAYOUTS, Layout, causal_pairs_match
from ray_zep.partition.plan import AttentionPlan, SeqPlacement
from ray_zep.partition.registry import register_placement, unregister_placement, variants
from ray_zep.partition.spec import PlacementSpec, Role
from ray_zep.partition.stats import plan_stats
from ray_zep.sim.compare import simulate_strategies
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel, simulate_batch
from ray_zep.topology import build_topology
from tests.helpers.procs import run_ranks
from tests.helpers.training import SMALL_RUN, max_relative_error, mixed_dataset, train_rank


class Contiguous(Layout):
    """R chunks; position r holds chunk r. Causal work is unbalanced: the last position
    computes against every earlier one, the first against none."""

    name = "contiguous"
    slots = 1
    before = ((0,), (0,))
    after = None

    def chunk_index(self, ring, position, slot):
        return np.asarray(position)


CONTIGUOUS = Contiguous()


def plan_contiguous_ring(lengths, topology, capacity, shape, parallel) -> AttentionPlan:
    """Every sequence over one ring of all ranks, each rank's share water-filled."""
    started = time.perf_counter()
    world = topology.world_size
    check_total(lengths, world, capacity, NAME)
    free = np.full(world, capacity, dtype=np.int64)
    ranks = tuple(range(world))
    placements = []
    for seq, n in enumerate(lengths.tolist()):
        counts = water_fill(n, free)
        free -= counts
        bounds = CONTIGUOUS.bounds_for_counts(counts.tolist())
        placements.append(SeqPlacement(seq, n, ranks, bounds, layout=CONTIGUOUS))
    plan = AttentionPlan(Placement(NAME), topology, capacity, tuple(placements))
    plan.planner_seconds = time.perf_counter() - started
    return plan


NAME = "contiguous_ring"


def _spec() -> PlacementSpec:
    """The placement's spec (declaring its `parallel.sequence` value)."""
    axis = declare_placement(NAME, "every sequence in contiguous chunks over one ring of all ranks")
    return PlacementSpec(axis, plan_contiguous_ring, layouts=(CONTIGUOUS,))


@contextlib.contextmanager
def _registered():
    """The placement registered while the block runs: other tests walking every placement
    must not meet it (and the ranks' processes, reused by other tests, forget it too)."""
    spec = register_placement(_spec())
    try:
        yield spec
    finally:
        unregister_placement(spec.axis.placement)


@pytest.fixture(autouse=True)
def registered():
    with _registered() as spec:
        yield spec


SHAPE = build_shape(load_config(None, ["model.n_heads=8", "model.n_kv_heads=2"]).model)
LENGTHS = np.asarray([300, 7, 1, 90, 40, 2, 129])


@pytest.mark.parametrize("layout", [*LAYOUTS.values(), CONTIGUOUS], ids=lambda lay: lay.name)
def test_every_layouts_steps_compute_each_causal_pair_once(layout: Layout) -> None:
    rng = np.random.default_rng(0)
    for ring in range(1, 6):
        counts = rng.integers(0, 9, size=ring).tolist()
        assert causal_pairs_match(layout, ring, layout.bounds_for_counts(counts)), (ring, counts)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=lambda lay: lay.name)
def test_every_layouts_own_offsets_are_the_generic_ones(layout: Layout) -> None:
    """A layout that spells out `bounds_for_counts` (on lists, and on arrays past
    `ARRAY_RING` positions) cuts exactly as the generic form from its `chunk_index`."""
    rng = np.random.default_rng(1)
    for ring in (1, 2, 3, 8, 64, 65, 130):
        counts = rng.integers(0, 1000, size=ring).tolist()
        assert layout.bounds_for_counts(counts) == Layout.bounds_for_counts(layout, counts), ring


def test_a_layout_whose_blocks_miss_pairs_fails_the_check() -> None:
    class Broken(Contiguous):
        name = "broken"
        before = None  # type: ignore[assignment]
        after = ((0,), (0,))

    assert not causal_pairs_match(Broken(), 3, (0, 4, 8, 12))


def test_the_registered_placement_plans_and_the_plan_reads_its_layout(registered) -> None:
    topology = build_topology(
        load_config(None, ["topology.nodes=2", "topology.gpus_per_node=2"]).topology
    )
    plan = make_plan(registered.axis.placement, LENGTHS, topology, 200, SHAPE)
    assert plan.rank_tokens().sum() == LENGTHS.sum()
    first = plan.placement(0)
    assert first.position_ranges(0) == [(0, first.bounds[1])], "rank 0 holds the head"
    assert first.position_ranges(3) == [(first.bounds[3], 300)], "rank 3 holds the tail"
    flops = plan_stats(plan, SHAPE).attention_flops
    assert flops[3] > 3 * flops[0], "the tail's queries see every earlier token"
    with pytest.raises(PlacementError, match="registered already"):
        register_placement(dataclasses.replace(registered, role=Role.REFERENCE))


SIMULATED = ["model.preset=7b", "topology.nodes=1", "topology.gpus_per_node=8",
             "parallel.weights=replicated", "train.tokens_per_rank=8192"]  # fmt: skip


def _step_seconds(name: str, lengths: np.ndarray, hardware: Hardware) -> float:
    config = load_config(None, [*SIMULATED, f"parallel.sequence={name}"])
    return simulate_batch(lengths, RunModel.create(config, hardware)).step_seconds


def test_the_registered_placement_simulates_beside_the_built_in_ones() -> None:
    config = load_config(None, SIMULATED)
    hardware = Hardware.preset(build_topology(config.topology))
    lengths = np.asarray([65536])
    assert NAME in variants()
    results = simulate_strategies(config, hardware, [lengths], (NAME, "te_cp"), 8192)
    assert results[NAME].error is None and results[NAME].steps
    # on the same ring, zigzag chunks balance causal work; contiguous ones leave the
    # last member the longest steps, which the simulator must see (compute-bound here:
    # one long sequence inside a node)
    steps = {name: _step_seconds(name, lengths, hardware) for name in (NAME, "te_cp")}
    assert steps[NAME] > 1.2 * steps["te_cp"], steps


def _train_all(rank: int, world: int, runs: dict[str, list[str]]) -> dict[str, dict]:
    with _registered():
        return {name: train_rank(rank, world, overrides) for name, overrides in runs.items()}


@pytest.mark.dist
def test_the_registered_placement_trains_like_one_process_on_2x2(tmp_path: Path) -> None:
    data = mixed_dataset(tmp_path / "mixed.parquet")
    base = [*SMALL_RUN, "model.n_heads=8", "model.n_kv_heads=2", "topology.nodes=2",
            "topology.gpus_per_node=2", "train.tokens_per_rank=64", "train.steps=3",
            "train.save_last=false", f"data.source={data}", "data.shuffle=false"]  # fmt: skip
    single = run_ranks(
        _train_all,
        1,
        {"single": [*base, "parallel.sequence=single", f"train.out_dir={tmp_path / 's'}"]},
    )[0]["single"]
    ring = run_ranks(
        _train_all,
        4,
        {NAME: [*base, f"parallel.sequence={NAME}", f"train.out_dir={tmp_path / 'r'}"]},
    )[0][NAME]
    assert sorted(single["losses"]) == [1, 2, 3] and ring["samples"] == single["samples"]
    for step, loss in single["losses"].items():
        assert ring["losses"][step] == pytest.approx(loss, rel=1e-5), f"step {step}"
    err, param = max_relative_error(ring["params"], single["params"])
    assert err <= 1e-5, f"parameter {param}: relative error {err:.2e}"
