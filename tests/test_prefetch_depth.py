"""Blocks gathered two ahead (`parallel.prefetch_depth`): the simulator lets a layer's
gather run into the next layer as the layer repeats (`ray_zep.sim.step`), the
memory model holds one more block, the unset depth follows its rule, and the key is
checked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ray_zep.config import load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.memory import model_memory
from ray_zep.run_memory import memory_inputs
from ray_zep.sim.bound import step_bound
from ray_zep.sim.events import Lane
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.idle import idle_causes
from ray_zep.sim.step import RunModel, plan_batch, simulate_plan, weights_of
from ray_zep.topology import build_topology
from tests.helpers.scenarios import WHOLE_EXCHANGES

pytestmark = pytest.mark.unit

WEIGHT_LATENCY = "weights gather/scatter latency"


def _run(depth: int, latency_us: float) -> RunModel:
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=8",
                                "model.preset=7b", "train.tokens_per_rank=5120",
                                "parallel.weights=fsdp", "parallel.sequence=zeppelin",
                                "parallel.routing=true", f"parallel.prefetch_depth={depth}",
                                "parallel.prefetch_after_attention=true",
                                "parallel.reshard_to_node=false",  # the backward's gather ahead
                                f"topology.intra_node_latency_us={latency_us}",
                                f"topology.inter_node_latency_us={latency_us}",
                                WHOLE_EXCHANGES])  # fmt: skip
    return RunModel.create(config, Hardware.preset(build_topology(config.topology)))


def _latency_task(timeline) -> tuple[int, object]:
    tasks = timeline.graph.tasks
    index = next(i for i, t in enumerate(tasks) if t.name == WEIGHT_LATENCY)
    return index, tasks[index]


@pytest.mark.parametrize("latency_us", [100.0, 1000.0])
def test_two_ahead_lets_the_gather_run_into_the_next_layer(latency_us) -> None:
    """64 GPUs, 7B under FSDP over every rank gathering after attention, links of
    `latency_us` per ring step (a gather's 63 steps: 6.3 ms; 63 ms, longer than a forward
    layer). One block ahead, the layer waits for its gather: the latency after every
    rank's attention, then the bytes. Two ahead, nobody in the layer waits for the gather
    it posts (for the block after next): it may run past the layer's end, and the one
    posted a layer earlier then runs as far into this layer, what is left of its latency
    first, then its bytes on every link. The layer is played as it repeats: that overrun
    is no less than the one the played layer's own gather has, and a gather starts after
    the one before it on FSDP2's stream. The backward's gather goes ahead the same way,
    its reduce-scatter is waited for in the layer. The step is shorter, and never under
    the bound, which counts every gather whole."""
    lengths = batch_lengths("arxiv", 4096 * 64, 0)
    runs = {depth: _run(depth, latency_us) for depth in (1, 2)}
    plan, remap = plan_batch(lengths, runs[1])
    steps = {d: simulate_plan(plan, run, True, remap) for d, run in runs.items()}
    assert weights_of(runs[2]).gathered_ahead and not weights_of(runs[1]).gathered_ahead
    one, two = steps[1].forward, steps[2].forward
    index, _ = _latency_task(one)
    assert not one.graph.ahead and one.start[index] > 0  # after the members' post
    assert one.makespan == pytest.approx(float(one.end.max()))  # the layer waits for it
    ahead = two.graph.ahead
    index, task = _latency_task(two)
    assert index in ahead and task.deps  # posted after attention, for a later block
    # on FSDP2's all-gather stream after the one posted a layer earlier
    assert two.start[index] >= max(two.end[i] for i, _ in two.graph.spill)
    latency, seconds = weights_of(runs[2]).layer_latency[0], weights_of(runs[2]).layer_sync[0]
    assert task.duration == pytest.approx(latency)
    assert two.graph.spill_bytes == pytest.approx(seconds - latency)
    over = max(0.0, float(two.end[ahead.start : ahead.stop].max()) - two.makespan)
    assert two.overrun == pytest.approx(over)
    spilled = two.graph.tasks[two.graph.spill_wait].duration
    parts = [two.graph.tasks[i].duration / share for i, share in two.graph.spill]
    played = spilled + max(parts)  # what the earlier gather runs into this layer
    assert played >= over - 1e-12
    assert max(parts) == pytest.approx(min(played, seconds - latency))
    if latency_us > 500:  # 63 ms of latency: the gather runs past the layer
        assert over > 0 and spilled > 0
    # the rank the gather is drawn for: its idle time adds up to the layer, not the gather
    idle = idle_causes(two, task.rank)
    assert sum(idle.values()) == pytest.approx(two.makespan - two.busy(task.rank, Lane.COMPUTE))
    hidden = steps[1].forward_layer_seconds - steps[2].forward_layer_seconds
    # a quarter of it at least (the 1 ms links: 16 of 63 ms; the Ulysses and remap
    # all-to-alls pay their messages' latency side by side, `ray_zep.sim.events`)
    assert hidden > 0.25 * min(latency, steps[1].forward_layer_seconds)
    # backward: the gather part goes ahead, the reduce-scatter is still waited for
    back_one, back_two = steps[1].backward, steps[2].backward
    assert not back_one.graph.ahead and back_two.graph.ahead and back_two.graph.spill
    assert back_two.graph.spill_bytes == pytest.approx(seconds - latency)
    assert back_two.makespan <= back_one.makespan
    bound = step_bound(lengths, runs[2]).seconds
    assert step_bound(lengths, runs[1]).seconds == bound <= steps[2].step_seconds


def test_two_ahead_holds_one_more_block() -> None:
    """7B under FSDP, blocks as units: two ahead holds three blocks gathered at the
    backward's peak, one ahead two (in bf16), and without prefetch one."""
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=2",
                                "model.preset=7b", "parallel.weights=fsdp"])  # fmt: skip
    shape, topology = build_shape(config.model), build_topology(config.topology)

    def params(**parallel) -> float:
        changed = dataclasses.replace(config.parallel, **parallel)
        inputs = memory_inputs(dataclasses.replace(config, parallel=changed), topology, 4096,
                               dtype=torch.bfloat16, on_cpu=False)  # fmt: skip
        return model_memory(shape, inputs).params

    block = shape.param_count() - 2 * shape.vocab_size * shape.dim
    block = (block - shape.dim) / shape.n_layers * 2  # bf16 bytes of one block
    one, two = params(prefetch_depth=1), params(prefetch_depth=2)
    assert two - one == pytest.approx(block, rel=1e-6)
    assert one - params(prefetch=False) == pytest.approx(block, rel=1e-6)


def test_unset_three_ahead_where_ranks_run_apart_else_two_where_a_gather_waits_two_ms() -> None:
    """Unset (`ray_zep.prefetch_plan.prefetch_depth`): cluster A, 7B under FSDP over every
    rank. Placements whose ranks run apart (`SequenceAxis.ranks_apart`: zeppelin, whole)
    gather three blocks ahead at every scale, under hsdp too. The others: one ahead at 64
    and 256 GPUs (a gather's ring steps: 0.24 and 0.98 ms), two at 1,024 (4.0 ms, the
    gather after attention), one at 4,096 (15.9 ms, but the gather at the block's start,
    where nothing runs before it) unless it goes after attention; one under hsdp (a node's
    8 GPUs). One where blocks are not units or nothing is prefetched; a set value is kept
    where blocks are units gathered with prefetch, the only place the key means anything."""
    from ray_zep.prefetch_plan import run_prefetch_depth

    def depth(gpus: int, *overrides: str) -> int:
        config = load_config(None, ["topology.preset=cluster_a", f"topology.nodes={gpus // 8}",
                                    "model.preset=7b", "train.tokens_per_rank=5120",
                                    "parallel.weights=fsdp", *overrides])  # fmt: skip
        topology, shape = build_topology(config.topology), build_shape(config.model)
        return run_prefetch_depth(config, topology, shape, 2)

    apart = "parallel.sequence=zeppelin"
    assert [depth(g, apart) for g in (64, 256, 1024, 4096)] == [3, 3, 3, 3]
    assert depth(64, "parallel.sequence=whole") == 3
    assert depth(4096, apart, "parallel.weights=hsdp") == 3
    assert depth(4096, apart, "parallel.fsdp_unit=linear") == 1
    assert depth(64, apart, "parallel.prefetch=false") == 1
    together = "parallel.sequence=ulysses"
    assert [depth(g, together) for g in (64, 256, 1024, 4096)] == [1, 1, 2, 1]
    assert depth(4096, together, "parallel.prefetch_after_attention=true") == 2
    assert depth(1024, together, "parallel.prefetch_after_attention=false") == 1
    assert depth(4096, together, "parallel.weights=hsdp") == 1
    assert depth(64, together, "parallel.prefetch_depth=3") == 3
    assert depth(64, apart, "parallel.prefetch_depth=2") == 2
    assert depth(64, apart, "parallel.prefetch_depth=2", "parallel.fsdp_unit=linear") == 1


def test_a_depth_outside_its_range_is_refused_by_name() -> None:
    for depth in (0, 5):
        with pytest.raises(ConfigError, match=r"parallel\.prefetch_depth"):
            load_config(None, [f"parallel.prefetch_depth={depth}"])
