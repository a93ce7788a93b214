"""`ray-zep plan`: place one batch with any planner and show where every token goes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from ray_zep.config import Config
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import SEQUENCE_AXES, WEIGHTS_AXES, Family, Placement
from ray_zep.partition import greedy_bins, plan_from_bins
from ray_zep.partition.plan import AttentionPlan
from ray_zep.partition.plan_memory import PlanMemory, memory_plan, plan_memory
from ray_zep.partition.stats import PlanStats, plan_stats
from ray_zep.report.layers import LayerReport
from ray_zep.report.placement import draw_placement, plan_record, rank_table
from ray_zep.report.text_table import Column, render_table
from ray_zep.sim.auto_ranking import AutoPlan, Candidate
from ray_zep.sim.bound import step_bound
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.ideal import ideal_step_seconds
from ray_zep.sim.request import BatchRequest, request_lengths
from ray_zep.sim.step import RunModel, simulate_plan
from ray_zep.topology import Topology, build_topology


@dataclasses.dataclass
class PlanResult:
    plan: AttentionPlan
    stats: PlanStats
    table: str
    layers: LayerReport
    memory: PlanMemory


def run_plan(config: Config, request: BatchRequest) -> PlanResult:
    """Place the requested batch with the configured placement (`parallel.sequence`).

    Raises:
        ConfigError: bad --lengths / --distribution values, or the reference placement
            (one process: nothing to place).
        PlacementError: the batch does not fit nodes x GPUs x L tokens.
    """
    topology = build_topology(config.topology)
    placement = config.parallel.sequence
    lengths = request_lengths(config, topology, request)
    shape = build_shape(config.model)
    capacity = config.train.tokens_per_rank
    if SEQUENCE_AXES[placement].planned:
        plan = memory_plan(placement, lengths, config, topology, shape)
    else:
        plan = _whole_sequence_plan(placement, lengths, topology, capacity)
    stats = plan_stats(plan, shape)
    layers = LayerReport.build(plan, shape)
    memory = plan_memory(config, topology, stats, shape)
    table = rank_table(plan, stats) + "\n\n" + layers.table() + "\n\n" + memory.table()
    modelled = modelled_line(config, topology, plan)
    return PlanResult(plan, stats, table + (f"\n\n{modelled}" if modelled else ""), layers, memory)


def modelled_line(config: Config, topology: Topology, plan: AttentionPlan) -> str | None:
    """The plan's simulated step on the topology's GPUs against the batch's ideal step and
    its bound (`ray_zep.sim.bound`); None under weight passing (simulated as a schedule
    of its own, `ray-zep simulate`)."""
    if WEIGHTS_AXES[config.parallel.weights].family is not Family.AUTOGRAD:
        return None
    run = RunModel.create(config, Hardware.preset(topology))
    step = simulate_plan(plan, run, config.parallel.routing).step_seconds
    ideal = ideal_step_seconds(plan.lengths, run)
    bound = step_bound(plan.lengths, run)
    return (
        f"modelled step {step:.4g} s on {topology.gpu_model}: {step / ideal:.2f}x its ideal "
        f"({ideal:.4g} s), {step / bound.seconds:.2f}x its bound ({bound.seconds:.4g} s; "
        f"largest part: {bound.largest})"
    )


def write_outputs(result: PlanResult, png: str | None, json_path: str | None) -> list[Path]:
    written = []
    if png and (picture := draw_placement(result.plan, result.stats, png)) is not None:
        written.append(picture)  # None: no matplotlib, the skip is logged
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = plan_record(result.plan, result.stats) | result.layers.record()
        path.write_text(json.dumps(record, indent=1) + "\n")
        written.append(path)
    return written


AUTO_COLUMNS = (
    Column("#", "place"),
    Column("composition", "name"),
    Column("step s", "step_seconds", ".4f"),
    Column("k tok/s", "tokens_per_second", ".1f", scale=1e3),
    Column("x bound", "over_bound", ".2f"),
    Column("GB/GPU", "memory_gb", ".1f"),
    Column("fits", "fits"),
    Column("documents", "documents"),
)


def auto_table(plan: AutoPlan, limit: int = 20) -> str:
    """The first `limit` candidates of `plan --auto`, fastest first: those that fit and train
    the config's documents whole, those that fit but cut them shorter, those that do not
    fit, then those that cannot run, each with why."""
    rows = [_auto_row(place, c) for place, c in enumerate(plan.ranked[:limit], 1)]
    lines = [render_table(rows, AUTO_COLUMNS, key_columns=2)]
    hidden = len(plan.ranked) - limit
    if hidden > 0:
        lines.append(f"... {hidden} more (--json has all)")
    return "\n".join(lines)


def _auto_row(place: int, candidate: Candidate) -> dict[str, object]:
    row = {"place": place, "name": candidate.name}
    if not candidate.steps:
        return row | {"error": f"cannot run: {candidate.error}"}
    return row | {
        "step_seconds": candidate.step_seconds,
        "tokens_per_second": candidate.tokens_per_second,
        "over_bound": candidate.over_bound,
        "memory_gb": candidate.memory_gb,
        "fits": "yes" if candidate.fits else "NO",
        "documents": "uncut" if candidate.cut_at is None else f"cut at {candidate.cut_at:,}",
    }


def _whole_sequence_plan(
    placement: Placement, lengths: np.ndarray, topology: Topology, capacity: int
) -> AttentionPlan:
    """Whole sequences: each on the rank with the fewest tokens, longest first."""
    if SEQUENCE_AXES[placement].one_process:
        raise ConfigError(
            f"parallel.sequence={placement.value} trains the whole batch in one process: "
            "nothing to place; choose another placement"
        )
    bins = greedy_bins(lengths, topology.world_size)
    return plan_from_bins(lengths, bins, topology, capacity, placement)
