"""A step of several micro-batches, simulated (`ray_zep.sim.micro_step`), and what it
means for the bound, the memory model and `ray-zep bench scale`."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ray_zep.bench.scale import ScaleBenchSpec, run_scale_bench
from ray_zep.config import load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import build_shape
from ray_zep.options import ActivationCheckpointing
from ray_zep.parallel.memory import FP32, model_memory, owned_params, state_bytes
from ray_zep.run_memory import memory_inputs
from ray_zep.sim.bound import PARTS, over_bound, step_bound
from ray_zep.sim.compare import variant_config
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.micro_step import micro_batched_step, split_batch
from ray_zep.sim.step import RunModel, plan_batch, simulate_plan
from ray_zep.topology import build_topology

pytestmark = pytest.mark.unit

L = 4096

KEEP_RESHARDING = ("parallel.reshard_to_node=false",)
"""The micro-batch rows' checkpointing and bound alone: the blocks resharded over every rank
(kept on the node, a row may take them with another checkpointing and its own bound)."""


def _arxiv_at_64(model: str) -> dict:
    """`ScaleBenchSpec`'s fields for one zeppelin row of arxiv on 64 GPUs, resharding over
    every rank (`KEEP_RESHARDING`)."""
    return dict(gpus=(64,), distributions=("arxiv",), models=(model,), placements=("zeppelin",),
                overrides=KEEP_RESHARDING)  # fmt: skip


def _run(nodes: int, capacity: int, parts: int, variant: str = "zeppelin") -> RunModel:
    config = load_config(None, ["topology.preset=cluster_a", f"topology.nodes={nodes}",
                                "model.preset=7b", "parallel.weights=fsdp",
                                f"train.micro_batches={parts}"])  # fmt: skip
    hardware = Hardware.preset(build_topology(config.topology))
    # an optimizer update that takes time (the presets' takes none), to count it once
    rates = dataclasses.replace(hardware.rates, optimizer_param_seconds=2e-10)
    hardware = dataclasses.replace(hardware, rates=rates)
    return RunModel.create(variant_config(config, variant, capacity), hardware)


def _micro_step(lengths: np.ndarray, nodes: int, parts: int, variant: str = "zeppelin"):
    """The batch as `parts` micro-batches of L / parts a step: the combined step and its
    micro-batches' own."""
    run = _run(nodes, L // parts, parts, variant)
    steps = []
    for part in split_batch(lengths, parts):
        plan, remap = plan_batch(part, run)
        steps.append(simulate_plan(plan, run, run.config.parallel.routing, remap))
    return micro_batched_step(steps), steps


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_a_batch_splits_into_parts_of_about_equal_tokens_holding_every_sequence(parts) -> None:
    lengths = batch_lengths("chat", 64 * L, 3)
    split = split_batch(lengths, parts)
    assert len(split) == parts
    assert sorted(np.concatenate(split).tolist()) == sorted(lengths.tolist())
    tokens = np.asarray([part.sum() for part in split])
    # longest first to the emptiest part: no part exceeds another by more than a sequence
    assert tokens.max() - tokens.min() <= lengths.max()
    if parts == 1:
        assert split[0] is lengths or np.array_equal(split[0], lengths)


@pytest.mark.parametrize("parts", [0, 9])
def test_a_batch_refuses_more_parts_than_sequences_or_none(parts) -> None:
    with pytest.raises(ConfigError, match="micro-batches"):
        split_batch(np.asarray([100] * 8), parts)


def test_the_micro_batches_add_up_and_update_once() -> None:
    lengths = batch_lengths("github", 16 * L * 9 // 10, 1)
    step, own = _micro_step(lengths, 2, 2)
    assert len(own) == 2 and step.micro_steps == tuple(own)
    assert step.tokens == int(lengths.sum())
    update = own[0].optimizer_seconds
    assert update > 0 and step.optimizer_seconds == update
    assert step.step_seconds == pytest.approx(sum(s.step_seconds for s in own) - update)
    for field in ("forward_layer_seconds", "backward_layer_seconds", "grad_sync_seconds",
                  "fixed_seconds", "head_seconds"):  # fmt: skip
        assert getattr(step, field) == pytest.approx(sum(getattr(s, field) for s in own))
    assert micro_batched_step(own[:1]) is own[0]


def test_where_the_rest_goes_sums_the_micro_batches_own_parts() -> None:
    lengths = batch_lengths("chat", 16 * L * 9 // 10, 2)
    step, own = _micro_step(lengths, 2, 2)
    whole = _run(2, L, 1)
    bound = step_bound(lengths, whole)
    parts = over_bound(step, bound, whole.shape.n_layers)
    alone = [over_bound(s, bound, whole.shape.n_layers) for s in own]
    assert list(parts) == [*PARTS, "rest"]
    for key in ("imbalance", "exposed transfers", "waits", "recompute"):
        assert parts[key] == pytest.approx(sum(a[key] for a in alone), abs=1e-12)
    assert bound.seconds + sum(parts.values()) == pytest.approx(step.step_seconds)


@pytest.mark.parametrize("distribution,variant,parts", [("chat", "zeppelin", 4),
                                                        ("arxiv", "zeppelin", 2),
                                                        ("chat", "te_cp", 2)])  # fmt: skip
def test_micro_batches_do_not_beat_the_whole_batch_bound(distribution, variant, parts) -> None:
    """The bound counts the batch's compute, the K/V its sequences must import with L
    tokens a rank at most, and the weights' collectives once: micro-batches of L / k hold
    fewer tokens a rank and repeat the collectives, so none beats it."""
    whole = _run(2, L, 1)
    for seed in range(2):
        lengths = batch_lengths(distribution, 16 * L * 9 // 10, seed)
        bound = step_bound(lengths, whole).seconds
        for k in range(2, parts + 1):
            step, _ = _micro_step(lengths, 2, k, variant)
            assert step.step_seconds >= bound * (1 - 1e-9), (seed, k, step.step_seconds, bound)


def test_micro_batches_keep_one_more_copy_of_the_gradients() -> None:
    shape = build_shape(load_config(None, ["model.preset=7b"]).model)
    topology = build_topology(load_config(None, ["topology.preset=cluster_a"]).topology)
    for weights in ("fsdp", "replicated"):
        one = load_config(None, ["topology.preset=cluster_a", f"parallel.weights={weights}"])
        two = dataclasses.replace(one, train=dataclasses.replace(one.train, micro_batches=2))
        inputs = [memory_inputs(c, topology, 4096) for c in (one, two)]
        copy = owned_params(shape, inputs[0]) * FP32
        assert copy > 0
        before, after = (model_memory(shape, m) for m in inputs)
        assert after.total - before.total == pytest.approx(copy), weights
        assert state_bytes(shape, inputs[1]) - state_bytes(shape, inputs[0]) == pytest.approx(copy)


def test_scale_rows_that_recompute_play_micro_batches_and_keep_the_fastest() -> None:
    """At 16k tokens per GPU a 7B rank of L tokens recomputes; the row plays the batch again
    as micro-batches of L / 2 and keeps it where faster (on this batch it is: no 7B rank of
    10k tokens recomputes as much), always on the whole batch's bound, and times each
    micro-batch's `plan_step` call apart besides the step's together. At 4k nothing
    recomputes and the row plays one batch a step."""
    case = _arxiv_at_64("7b")
    (one,) = run_scale_bench(ScaleBenchSpec(**case, tokens_per_gpu=(16384,), micro_batches=1),
                             progress=lambda line: None)  # fmt: skip
    (best,) = run_scale_bench(ScaleBenchSpec(**case, tokens_per_gpu=(16384,), micro_batches=2),
                              progress=lambda line: None)  # fmt: skip
    assert one.micro_batches == 1 and one.recompute_s > 0
    assert best.micro_batches == 2 and best.step_s < one.step_s
    assert best.recompute_s < one.recompute_s
    bound = one.step_s / one.step_over_bound
    assert best.step_s / best.step_over_bound == pytest.approx(bound)  # the same bound
    assert best.fits == "yes" and best.tokens_per_s_per_gpu > one.tokens_per_s_per_gpu
    # the step plans two batches, one `plan_step` call each: the slowest call is one of them
    assert 0 < best.planner_ms_call < best.planner_ms_max
    assert one.planner_ms_call == pytest.approx(one.planner_ms_max)  # one call a step
    (small,) = run_scale_bench(ScaleBenchSpec(**case, tokens_per_gpu=(4096,)),
                               progress=lambda line: None)  # fmt: skip
    assert small.micro_batches == 1 and small.recompute_s == 0
    with pytest.raises(ConfigError, match="--micro-batches"):
        ScaleBenchSpec(micro_batches=0)


def test_scale_rows_try_every_micro_batch_count_while_they_recompute(monkeypatch) -> None:
    """A 13B row of arxiv at 16k tokens per GPU still recomputes as 2 micro-batches of
    L / 2: it is played as 3 of L / 3 next (not only doublings), which recompute nothing,
    and the row keeps the fastest of the three, its recomputation with it."""
    import ray_zep.bench.scale as scale

    tried = []
    measure = scale._measure

    def recorded(row, config, *args):
        measure(row, config, *args)
        tried.append((row.micro_batches, config.train.tokens_per_rank, row.recompute_s,
                      row.step_s))  # fmt: skip

    monkeypatch.setattr(scale, "_measure", recorded)
    case = _arxiv_at_64("13b")
    (row,) = run_scale_bench(ScaleBenchSpec(**case, tokens_per_gpu=(16384,), micro_batches=3),
                             progress=lambda line: None)  # fmt: skip
    assert [(parts, capacity) for parts, capacity, *_ in tried] == [(1, 20480), (2, 10240),
                                                                   (3, 6827)]  # fmt: skip
    assert tried[1][2] > 0  # 2 still recomputed
    fastest = min(tried, key=lambda one: one[3])
    assert (row.micro_batches, row.step_s) == (fastest[0], fastest[3])
    assert tried[2][2] == 0 and row.tokens_per_rank == 20480
    assert row.recompute_s == fastest[2]


def test_plan_auto_plays_a_recomputing_composition_as_micro_batches(tmp_path) -> None:
    """64 GPUs of cluster A, 7B, arxiv at 16k tokens per GPU (L = 20,480): a rank of L
    tokens recomputes some blocks. The fastest composition is played again as 2, 3 and 4
    micro-batches of L / 2, L / 3 and L / 4 on the same batch, on that batch's bound; 2 of
    them step faster than the one batch (no 7B rank of 10k tokens recomputes as much) and
    than 3 or 4 (each more micro-batch repeats the collectives), win, and the YAML trains
    them."""
    from ray_zep.sim.auto import AutoPlan, _micro_batched, evaluate_group, write_best
    from ray_zep.sim.request import SimulateRequest, batches_of, request_hardware

    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=8",
                                "model.preset=7b", "train.tokens_per_rank=20480",
                                "parallel.sequence=zeppelin", "parallel.weights=fsdp",
                                "data.packing=budget",
                                "data.batch_fill=0.8"])  # fmt: skip
    hardware, on_gpu = request_hardware(config, None)
    request = SimulateRequest(None, False, 1, "arxiv", tokens=16384 * 64)
    batches = [(b, None) for b in batches_of(config, hardware.topology, request)[0]]
    (one,) = evaluate_group([config], hardware, batches, on_gpu)
    assert one.config.train.activation_checkpointing is not ActivationCheckpointing.NONE
    micro = _micro_batched(AutoPlan([one]), config, hardware, lambda _: batches, on_gpu)
    assert [c.config.train.micro_batches for c in micro] == [2, 3, 4]
    assert [c.config.train.tokens_per_rank for c in micro] == [10240, 6827, 5120]
    for candidate in micro:
        assert candidate.bounds == one.bounds and candidate.fits
        assert candidate.steps[0].tokens == one.steps[0].tokens
        assert candidate.over_bound >= 1.0
    plan = AutoPlan([one, *micro])
    assert plan.best.config.train.micro_batches == 2, [c.name for c in plan.ranked]
    assert plan.best.step_seconds < one.step_seconds
    assert plan.best.name.endswith("+micro_batches=2+L=10240"), plan.best.name
    chosen = load_config(write_best(plan, tmp_path / "best.yaml"), [])
    assert chosen.train.micro_batches == 2 and chosen.train.tokens_per_rank == 10240
    assert _micro_batched(AutoPlan(micro[:1]), config, hardware, lambda _: batches, on_gpu) == []


def test_simulate_plays_a_step_of_the_configured_micro_batches() -> None:
    """`ray-zep simulate` on a config training 2 micro-batches a step: a step's batch
    holds 2 x ranks x L tokens by default, the one-plan variants play it as 2 micro-batches
    of L, and the baselines that schedule their own micro-batches the whole of it."""
    from ray_zep.sim.request import SimulateRequest, run_simulate

    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=2",
                                "model.preset=7b", "parallel.weights=fsdp",
                                f"train.tokens_per_rank={L}", "train.micro_batches=2"])  # fmt: skip
    request = SimulateRequest("zeppelin,megatron_dynamic_cp", batches=1, distribution="chat")
    result = run_simulate(config, request)
    (lengths,) = result.batches
    assert int(lengths.sum()) == 2 * 16 * L
    assert result.tokens_per_rank == int(L * 1.25)
    zeppelin = result.results["zeppelin"].steps[0]
    assert len(zeppelin.micro_steps) == 2 and zeppelin.tokens == int(lengths.sum())
    run = _run(2, result.tokens_per_rank, 2)
    rates = dataclasses.replace(run.hardware.rates, optimizer_param_seconds=0.0)
    run = dataclasses.replace(run, hardware=dataclasses.replace(run.hardware, rates=rates))
    own = []
    for part in split_batch(lengths, 2):
        plan, remap = plan_batch(part, run)
        own.append(simulate_plan(plan, run, run.config.parallel.routing, remap))
    assert zeppelin.step_seconds == pytest.approx(micro_batched_step(own).step_seconds)
    assert not result.results["megatron_dynamic_cp"].steps[0].micro_steps
    assert result.over_bound(result.results["zeppelin"]) >= 1.0


def test_simulate_on_the_data_plays_its_consecutive_batches_as_the_micro_batches() -> None:
    """Without a distribution a step's micro-batches are the data's consecutive batches,
    as the trainer draws them, not a split of their union."""
    from ray_zep.sim.replay import data_batches
    from ray_zep.sim.request import SimulateRequest, run_simulate, step_batches

    config = load_config(None, ["topology.nodes=2", "topology.gpus_per_node=2",
                                "parallel.sequence=zeppelin", "data.packing=budget",
                                "train.tokens_per_rank=512", "train.micro_batches=2"])  # fmt: skip
    request = SimulateRequest("zeppelin", batches=2)
    topology = build_topology(config.topology)
    batches, steps, capacity = step_batches(config, topology, request)
    drawn = [lengths for lengths, _ in data_batches(config, 4, 0, 4)]
    assert capacity == 512 and [len(parts) for parts in steps] == [2, 2]
    for b, parts in enumerate(steps):
        for i, part in enumerate(parts):
            assert np.array_equal(part, drawn[2 * b + i])
        assert np.array_equal(batches[b], np.concatenate(parts))
    result = run_simulate(config, request)
    for step, parts in zip(result.results["zeppelin"].steps, steps, strict=True):
        assert [s.tokens for s in step.micro_steps] == [int(p.sum()) for p in parts]
