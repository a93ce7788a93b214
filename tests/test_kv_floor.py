"""The floor `plan --auto` prunes with is below every simulated step, close under the
ring-bound and the compute-bound ones, and pruning leaves the ranking's winner, runner-up
and played steps as playing everything does."""

from __future__ import annotations

import pytest

from ray_zep.bench.scale import batch_lengths
from ray_zep.config import load_config
from ray_zep.partition.stats import plan_stats
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.kv_floor import busiest_compute, kv_floor_seconds
from ray_zep.sim.step import RunModel, plan_batch, simulate_plan
from ray_zep.topology import build_topology

CASES = [  # (placement, routing, compression, data)
    ("te_cp", False, "off", "github"),
    ("te_cp", True, "off", "github"),
    ("te_cp", True, "always", "github"),
    ("zeppelin", True, "off", "chat"),
    ("zeppelin", False, "off", "github"),
    ("fill", True, "off", "github"),
    ("usp", False, "off", "arxiv"),
    ("hybrid_dp", True, "off", "github"),
    ("llama_cp", False, "off", "arxiv"),
]


def _step(placement: str, routing: bool, compression: str, data: str, nodes: int = 4,
          weights: str = "fsdp"):  # fmt: skip
    config = load_config(None, ["topology.preset=cluster_a", f"topology.nodes={nodes}",
                                "model.preset=7b", "train.tokens_per_rank=5120",
                                f"parallel.weights={weights}", f"parallel.sequence={placement}",
                                f"parallel.routing={str(routing).lower()}",
                                f"comm.compression={compression}"])  # fmt: skip
    run = RunModel.create(config, Hardware.preset(build_topology(config.topology)))
    plan, remap = plan_batch(batch_lengths(data, 4096 * nodes * 8, 0), run)
    return plan, run, simulate_plan(plan, run, routing, remap)


@pytest.mark.parametrize(("placement", "routing", "compression", "data"), CASES)
def test_the_floor_is_under_the_simulated_layers(placement, routing, compression, data) -> None:
    plan, run, step = _step(placement, routing, compression, data)
    layers = run.shape.n_layers * (step.forward_layer_seconds + step.backward_layer_seconds)
    floor = kv_floor_seconds(plan, run, routing)
    assert 0.0 <= floor <= layers <= step.step_seconds
    compute = busiest_compute(plan_stats(plan, run.shape), run, remapped=False)
    assert floor <= kv_floor_seconds(plan, run, routing, compute) <= layers
    if placement == "llama_cp":  # its K/V are all-gathered: the longest gather counts
        assert floor > 0.0


def test_the_floor_is_close_under_a_ring_bound_by_its_nics() -> None:
    """te_cp's one ring over every rank sends each rank's K/V through one NIC a hop: its
    step is the NIC's bytes and little else."""
    plan, run, step = _step("te_cp", False, "off", "github")
    assert kv_floor_seconds(plan, run, False) > 0.8 * step.step_seconds


def test_the_busiest_ranks_compute_is_close_under_a_compute_bound_layer() -> None:
    """hybrid_dp keeps the chat mix's long documents whole on one rank each, and replicated
    weights add no collective: that rank's compute is most of the layer."""
    plan, run, step = _step("hybrid_dp", False, "off", "chat", weights="replicated")
    layers = run.shape.n_layers * (step.forward_layer_seconds + step.backward_layer_seconds)
    compute = busiest_compute(plan_stats(plan, run.shape), run, remapped=False)
    assert 0.8 * layers < kv_floor_seconds(plan, run, False, compute) <= layers


def test_pruning_leaves_the_ranking_as_playing_everything(monkeypatch) -> None:
    from ray_zep.sim import auto
    from ray_zep.sim.request import request_hardware

    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=2", "model.preset=7b",
                                "train.tokens_per_rank=5120", "parallel.sequence=zeppelin",
                                "data.packing=budget", "data.batch_fill=0.8"])  # fmt: skip
    hardware, on_gpu = request_hardware(config, None)
    batches = [(batch_lengths("github", 4096 * 16, 0), None)]
    pruned = auto.auto_plan(config, hardware, lambda _: batches, on_gpu)
    monkeypatch.setattr(auto, "second_fastest", lambda *_: None)
    every = auto.auto_plan(config, hardware, lambda _: batches, on_gpu)
    skipped = [c for c in pruned.candidates if c.error and c.error.startswith("not played")]
    assert skipped, "no composition was pruned"
    assert pruned.best.name == every.best.name and pruned.why() == every.why()
    steps = {c.name: c.step_seconds for c in every.candidates if c.steps}
    for c in pruned.candidates:
        if c.steps:
            assert c.step_seconds == steps[c.name]
    for c in skipped:  # each pruned one is slower than the runner-up when played
        assert steps[c.name] > sorted(set(steps.values()))[1]


def test_the_search_reports_each_group_and_phase_as_it_ends() -> None:
    from ray_zep.sim.auto import auto_plan, search_steps
    from ray_zep.sim.request import request_hardware

    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=2", "model.preset=7b",
                                "train.tokens_per_rank=5120"])  # fmt: skip
    hardware, on_gpu = request_hardware(config, None)
    batches = [(batch_lengths("arxiv", 4096 * 16, 0), None)]
    lines: list[str] = []
    result = auto_plan(config, hardware, lambda _: batches, on_gpu, progress=lines.append)
    assert len(lines) == search_steps(config, 16)
    played = [c for c in result.candidates if c.steps]
    assert any(line.startswith(f"{played[0].name}: ") for line in lines)
    assert lines[-5:] == [
        "more token room played",
        "shard groups played",
        "K/V room played",
        "micro-batches played",
        "done",
    ]
