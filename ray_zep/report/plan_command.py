"""`ray-zep plan`: place one batch with any planner and show where every token goes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from ray_zep.command_args import parse_lengths
from ray_zep.config import Config
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import SEQUENCE_AXES, Placement
from ray_zep.partition import PLANNED, greedy_bins, make_plan, plan_from_bins
from ray_zep.partition.plan import AttentionPlan
from ray_zep.partition.plan_memory import PlanMemory, plan_memory
from ray_zep.partition.stats import PlanStats, plan_stats
from ray_zep.report.layers import LayerReport
from ray_zep.report.placement import draw_placement, plan_record, rank_table
from ray_zep.topology import Topology, build_topology


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What to place: explicit lengths, a synthetic distribution, or a batch of the data."""

    lengths: str | None = None
    distribution: str | None = None
    tokens: int | None = None
    batch: int = 0


@dataclasses.dataclass
class PlanResult:
    plan: AttentionPlan
    stats: PlanStats
    table: str
    layers: LayerReport
    memory: PlanMemory


def run_plan(config: Config, request: PlanRequest) -> PlanResult:
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
    if placement in PLANNED:
        plan = make_plan(placement, lengths, topology, capacity, shape, config.parallel)
    else:
        plan = _whole_sequence_plan(placement, lengths, topology, capacity)
    stats = plan_stats(plan, shape)
    layers = LayerReport.build(plan, shape)
    memory = plan_memory(config, topology, stats, shape)
    table = rank_table(plan, stats) + "\n\n" + layers.table() + "\n\n" + memory.table()
    return PlanResult(plan, stats, table, layers, memory)


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


def request_lengths(config: Config, topology: Topology, request: PlanRequest) -> np.ndarray:
    """Sequence lengths of the batch to place."""
    chosen = [request.lengths is not None, request.distribution is not None]
    if all(chosen):
        raise ConfigError("give either --lengths or --distribution, not both")
    if request.lengths is not None:
        return parse_lengths(request.lengths)
    if request.distribution is not None:
        from ray_zep.data.synthetic import batch_lengths

        total = request.tokens or topology.world_size * config.train.tokens_per_rank
        if total < 1:
            raise ConfigError(f"--tokens={total} must be >= 1")
        return batch_lengths(request.distribution, total, config.train.seed)
    return _data_batch_lengths(config, topology, request.batch)


def _data_batch_lengths(config: Config, topology: Topology, index: int) -> np.ndarray:
    """Lengths of batch `index` of the configured data, as training would see it."""
    from ray_zep.data.batching import BatchStream
    from ray_zep.data.catalog import open_configured_source

    if index < 0:
        raise ConfigError(f"--batch={index} must be >= 0")
    stream = BatchStream.from_config(open_configured_source(config), config, topology.world_size)
    for _ in range(index):
        stream.next_batch()
    return stream.next_batch().lengths


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
