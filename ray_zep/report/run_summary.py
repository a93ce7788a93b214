"""The end of `ray-zep train`: what the run did, and what TE CP would have done on its batches.

Measured, from the run's metrics.jsonl: throughput (steady state: the first step
left out), the balance of tokens and FLOPs over ranks (max over mean, per step)
and the bytes that crossed nodes (`comm_bytes`, from the traffic model of what
ran). Modelled, by replaying the run's data stream (the same seed gives the same
batches): the attention bytes and the simulated step time of the run's
placement and of TE CP's (`te_cp`: even zigzag split of every sequence over all
ranks) on the same batches, at the rates of the topology's GPU preset.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_zep.config import Config
from ray_zep.costmodel import preset_gpu, preset_rates
from ray_zep.data.batching import BatchStream
from ray_zep.data.catalog import open_configured_source
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import Placement
from ray_zep.partition import registry
from ray_zep.partition.plan_memory import memory_plan
from ray_zep.remap.policy import choose_remap
from ray_zep.report.run_plots import imbalance, rank_matrix, steady_tokens_per_second
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel, simulate_plan
from ray_zep.topology import Topology
from ray_zep.traffic import attention_step_traffic

GB = 1e9


@dataclass(frozen=True)
class Modelled:
    """One placement on the run's batches (modelled): attention bytes between nodes,
    whole job, all batches, and the mean simulated step time."""

    name: str
    inter_node_bytes: float
    step_seconds: float


@dataclass(frozen=True)
class TeCpComparison:
    """The run's placement and TE CP's on the same batches."""

    batches: int
    hardware: str
    ours: Modelled
    te_cp: Modelled


def replay_lengths(config: Config, world: int, steps: int) -> list[np.ndarray]:
    """Sequence lengths of the run's first `steps` batches, drawn again from its data."""
    stream = BatchStream.from_config(open_configured_source(config), config, world)
    batches = []
    for _ in range(steps):
        batch = stream.next_batch()
        batches.append(np.asarray([len(t) for t in batch.tokens], dtype=np.int64))
    return batches


COMPARED_BATCHES = 100
"""At most this many of the run's first batches are replayed for the comparison."""


def compare_with_te_cp(config: Config, topology: Topology, steps: int) -> TeCpComparison:
    """The run's placement and TE CP's, modelled on the run's first `steps` batches
    (at most `COMPARED_BATCHES`).

    Raises:
        ZepError: a planner cannot place a batch (e.g. under the run's memory limits).
    """
    batches = replay_lengths(config, topology.world_size, min(steps, COMPARED_BATCHES))
    parallel = config.parallel
    ours = _modelled(config, topology, batches, parallel.sequence, parallel.routing, parallel.remap)
    reference = registry.reference().axis.placement
    te_cp = _modelled(config, topology, batches, reference, False, False)
    return TeCpComparison(len(batches), preset_gpu(topology.gpu_model), ours, te_cp)


def _modelled(config, topology, batches, placement: Placement, routed: bool, remap: bool):
    shape, parallel = build_shape(config.model), config.parallel
    rates = preset_rates(topology.gpu_model)
    run = RunModel.create(config, Hardware(topology, rates))
    variant = registry.variants().get(placement.value)
    if variant is not None and variant.te_wire:  # as TransformerEngine sends dK/dV
        run = run.with_te_wire()
    inter, seconds = 0.0, []
    for lengths in batches:
        plan = memory_plan(placement, lengths, config, topology, shape)
        moved = (choose_remap(plan, shape, rates, parallel.remap_policy, parallel.ulysses_pieces)
                 if remap else None)  # fmt: skip
        inter += attention_step_traffic(plan, shape, routed, moved,
                                        dkv_owner=run.dkv_owner).inter_node  # fmt: skip
        seconds.append(simulate_plan(plan, run, routed, moved).step_seconds)
    return Modelled(placement.value, inter, float(np.mean(seconds)) if seconds else 0.0)


def summary_lines(rows: list[dict], comparison: TeCpComparison | None) -> list[str]:
    """A few lines a person reads at the end of a run (`rows`: its step rows)."""
    throughput = steady_tokens_per_second(rows)
    lines = [f"throughput: {throughput / 1e3:.2f}k tokens/s (steps 2-{len(rows)})"]
    balances = _balances(rows[1:] or rows)
    lines.append("balance over ranks (max / mean per step): " + ", ".join(balances))
    crossed = sum(r.get("comm_bytes", {}).get("inter_node", 0) for r in rows)
    lines.append(
        f"bytes between nodes (all traffic, traffic model of what ran): {crossed / GB:.3f} GB "
        f"over {len(rows)} steps"
    )
    if comparison is not None:
        lines += _comparison_lines(comparison)
    return lines


def _balances(rows: list[dict]) -> list[str]:
    out = []
    for key, label in (("rank_tokens", "tokens"), ("rank_flops", "FLOPs")):
        matrix = rank_matrix(rows, key)
        if matrix is not None:
            mean, worst = imbalance(matrix)
            out.append(f"{label} {mean:.2f} mean, {worst:.2f} worst")
    return out or ["not recorded"]


def _comparison_lines(c: TeCpComparison) -> list[str]:
    ours, te_cp = c.ours, c.te_cp
    speedup = te_cp.step_seconds / ours.step_seconds if ours.step_seconds else float("nan")
    return [
        f"modelled on the run's first {c.batches} batches ({c.hardware} rates, attention traffic):",
        f"  {ours.name}: {ours.inter_node_bytes / GB:.3f} GB between nodes, "
        f"{ours.step_seconds * 1e3:.2f} ms/step",
        f"  te_cp: {te_cp.inter_node_bytes / GB:.3f} GB between nodes, "
        f"{te_cp.step_seconds * 1e3:.2f} ms/step ({speedup:.2f}x {ours.name}'s step time)",
    ]
