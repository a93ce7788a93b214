"""`ray-zep plan`: place one batch with any planner and show where every token goes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from ray_zep.config import Config, Precision
from ray_zep.errors import ConfigError, MemoryPlanError
from ray_zep.model.shapes import ModelShape, build_shape
from ray_zep.parallel.axes import SEQUENCE_AXES, Placement, WeightsMode
from ray_zep.parallel.memory import GB, RankMemory, memory_inputs, model_memory
from ray_zep.partition import PLANNED, greedy_bins, make_plan, plan_from_bins
from ray_zep.partition.plan import AttentionPlan, Zone
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


@dataclasses.dataclass(frozen=True)
class PlanMemory:
    """The modelled per-rank memory of a plan, and the GPU it must fit."""

    ranks: list[RankMemory]
    tokens: list[int]
    gpu_bytes: float
    gpu_model: str
    how: str
    """Compute dtype and kernel the model assumed."""
    weights: str
    alternative: tuple[str, RankMemory] | None = None
    """Another weights mode's figure for the fullest rank, when this one does not fit."""

    @property
    def fullest(self) -> int:
        return max(range(len(self.ranks)), key=lambda r: self.ranks[r].total)

    @property
    def fits(self) -> bool:
        return not self.gpu_bytes or self.ranks[self.fullest].total <= self.gpu_bytes

    def table(self) -> str:
        r = self.fullest
        gpu = f"{self.gpu_bytes / GB:.0f} GB ({self.gpu_model})" if self.gpu_bytes else "unknown"
        return (
            f"per-rank memory, modelled ({self.how}), parallel.weights={self.weights}: "
            f"fullest rank {r} ({self.tokens[r]} tokens) {self.ranks[r].describe()}; "
            f"GPU memory {gpu}: {'fits' if self.fits else 'DOES NOT FIT'}"
        )

    def check(self) -> None:
        """Raises MemoryPlanError naming the figure and the axis to change."""
        if self.fits:
            return
        r = self.fullest
        advice = (
            "set parallel.weights=fsdp or hsdp, train.activation_checkpointing=full, or "
            "lower train.tokens_per_rank"
        )
        if self.alternative is not None:
            name, other = self.alternative
            fits = "fits" if other.total <= self.gpu_bytes else "does not fit either"
            advice = f"parallel.weights={name} models {other.total / GB:.1f} GB ({fits}); " + advice
        raise MemoryPlanError(
            f"per-rank memory {self.ranks[r].total / GB:.1f} GB (rank {r}, {self.tokens[r]} "
            f"tokens, parallel.weights={self.weights}) exceeds the {self.gpu_bytes / GB:.0f} GB "
            f"of one {self.gpu_model}: {advice}"
        )


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


def plan_memory(
    config: Config, topology: Topology, stats: PlanStats, shape: ModelShape
) -> PlanMemory:
    """Every rank's modelled memory for the plan's tokens (GPU presets: bf16, flash-attn)."""
    on_gpu = topology.gpu_memory_bytes > 0
    bf16 = on_gpu and config.train.precision is not Precision.FP32
    flash = on_gpu and bf16 and config.model.attention_kernel != "torch"
    dtype = torch.bfloat16 if bf16 else torch.float32
    how = ("bf16" if bf16 else "fp32") + (", flash-attn" if flash else ", torch attention")
    tokens = [int(t) for t in stats.tokens]

    def ranks_of(cfg: Config) -> list[RankMemory]:
        out = []
        for rank, held in enumerate(tokens):
            ring = sum(n for zone, n in stats.zones[rank].items() if zone != Zone.LOCAL.value)
            inputs = memory_inputs(cfg, topology, held, ring, dtype, flash, not on_gpu)
            out.append(model_memory(shape, inputs))
        return out

    weights = config.parallel.weights
    memory = PlanMemory(ranks_of(config), tokens, topology.gpu_memory_bytes,
                        topology.gpu_model, how, weights.value)  # fmt: skip
    if memory.fits or weights is WeightsMode.FSDP:
        return memory
    parallel = dataclasses.replace(config.parallel, weights=WeightsMode.FSDP)
    other = ranks_of(dataclasses.replace(config, parallel=parallel))
    alternative = (WeightsMode.FSDP.value, other[memory.fullest])
    return dataclasses.replace(memory, alternative=alternative)


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


def parse_lengths(text: str, flag: str = "--lengths") -> np.ndarray:
    """'9000,300,64k' -> positive token counts (k = 1024); errors name `flag`."""
    values = []
    for item in text.replace(" ", "").split(","):
        scale = 1024 if item.lower().endswith("k") else 1
        digits = item[:-1] if scale > 1 else item
        if not digits.isdigit() or int(digits) < 1:
            raise ConfigError(
                f"{flag} item {item!r} must be a positive integer (optionally with k), "
                f"e.g. {flag} 9000,300,64k"
            )
        values.append(int(digits) * scale)
    return np.asarray(values, dtype=np.int64)


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
