"""Ranks running ahead of one another across layers (`ray_zep.sim.drift`): bands of ranks
joined by their queue items, the leads the weights' collectives allow, and a simulated
step that counts what they save."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ray_zep.config import load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.sim.bound import over_bound, step_bound
from ray_zep.sim.drift import bands, drifting_layers, rank_ends
from ray_zep.sim.events import Lane, TaskGraph, Timeline
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel, plan_batch, simulate_plan
from ray_zep.topology import build_topology

pytestmark = pytest.mark.unit


def _plan(world: int, *items: tuple[int, ...]) -> SimpleNamespace:
    """What `drifting_layers` reads of a plan: its world and its items' ranks."""
    return SimpleNamespace(world=world, items=lambda: [SimpleNamespace(ranks=r) for r in items])


def _layer(ends: list[float]) -> Timeline:
    """One compute task a rank, ending at `ends[rank]`."""
    graph = TaskGraph()
    for rank, end in enumerate(ends):
        graph.add("work", rank, Lane.COMPUTE, end)
    return Timeline(graph, np.zeros(len(ends)), np.asarray(ends, dtype=np.float64))


def test_ranks_joined_by_items_form_one_band_lone_ranks_their_own() -> None:
    plan = _plan(7, (0,), (1, 2), (2, 3), (5, 6), (6,))
    assert bands(plan).tolist() == [0, 1, 1, 1, 4, 5, 5]


def test_a_layers_ends_are_each_ranks_last_task() -> None:
    graph = TaskGraph()
    graph.add("a", 0, Lane.COMPUTE, 1.0)
    graph.add("b", 0, Lane.INTER_NODE, 0.5)
    graph.add("c", 1, Lane.COMPUTE, 2.0)
    timeline = Timeline(graph, np.array([0.0, 1.0, 0.0]), np.array([1.0, 1.5, 2.0]))
    assert rank_ends(timeline, 3).tolist() == [1.5, 2.0, 0.0]


def test_two_lone_ranks_one_block_apart_by_hand() -> None:
    """Rank 0 forward 1.0, backward 2.0 a layer; rank 1 0.8 and 2.4; 10 layers. In step
    (depth 1): 10 x (1.0 + 2.4) = 34. Gathered two ahead, rank 1 may lead by a block: it
    starts layer l at 0.8 l until rank 0's start of layer l - 1 holds it (l - 1 from
    layer 5), ending the forward at 8.8 against rank 0's 10; in backward it is the slower,
    never held (8.8 + 10 x 2.4 = 32.8), and rank 0, held a block behind it from layer 9,
    ends at 30."""
    forward, backward = _layer([1.0, 0.8]), _layer([2.0, 2.4])
    plan = _plan(2, (0,), (1,))
    assert drifting_layers(forward, backward, plan, 10, 1, False) == pytest.approx(34.0)
    assert drifting_layers(forward, backward, plan, 10, 2, False) == pytest.approx(32.8)
    free = max(10 * (1.0 + 2.0), 10 * (0.8 + 2.4))
    assert drifting_layers(forward, backward, plan, 10, 4, False) == pytest.approx(free)


def test_ranks_of_one_item_or_joined_every_layer_stay_in_step() -> None:
    forward, backward = _layer([1.0, 0.8]), _layer([2.0, 2.4])
    assert drifting_layers(forward, backward, _plan(2, (0, 1)), 10, 3, False) == 34.0
    assert drifting_layers(forward, backward, _plan(2, (0,), (1,)), 10, 3, True) == 34.0


def _run(depth: int) -> RunModel:
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=4",
                                "model.preset=7b", "train.tokens_per_rank=10240",
                                "parallel.weights=fsdp", "parallel.sequence=zeppelin",
                                f"parallel.prefetch_depth={depth}"])  # fmt: skip
    return RunModel.create(config, Hardware.preset(build_topology(config.topology)))


def test_a_step_gathered_ahead_saves_what_its_bands_lead_and_stays_above_its_bound() -> None:
    """32 GPUs, 7B, an arxiv batch of 4k tokens a GPU: one block ahead the step is its
    layers played in step; two and three ahead the same layers end sooner (the drift,
    no more than the busiest rank's waits), and never before the step's bound."""
    lengths = batch_lengths("arxiv", 32 * 4096, 3)
    steps = {}
    for depth in (1, 2, 3):
        run = _run(depth)
        plan, remap = plan_batch(lengths, run)
        steps[depth] = step = simulate_plan(plan, run, False, remap)
        layers = run.shape.n_layers * (step.forward.makespan + step.backward.makespan)
        parts = step.breakdown(run.shape.n_layers)
        assert parts["layers_forward"] + parts["layers_backward"] == pytest.approx(layers)
        assert sum(parts.values()) == pytest.approx(step.step_seconds)
        assert parts["drift"] == -step.drift_seconds <= 0.0
        bound = step_bound(lengths, run)
        assert step.step_seconds > bound.seconds
        assert over_bound(step, bound, run.shape.n_layers)["waits"] >= -1e-9
    assert steps[1].drift_seconds == 0.0
    assert 0.0 < steps[2].drift_seconds < steps[3].drift_seconds
