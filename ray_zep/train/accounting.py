"""What a step did, as whole-job figures: `StepStats` and the per-rank parts summed into it.

Each rank puts its share of every figure (losses, compression bytes per stream, tokens
per zone, attention FLOPs, modelled and measured memory in its own slot) into one
float64 vector; a single all-reduce sums them, and rank 0 reports the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ray_zep.attention.kernels import tiled
from ray_zep.data.shards import RankShard
from ray_zep.parallel.memory import RankMemory, model_memory
from ray_zep.partition.node_reshard import with_node_shards
from ray_zep.partition.plan import Zone, zone_of
from ray_zep.run_memory import memory_inputs
from ray_zep.train.runners import StepContext

ZONES = (Zone.LOCAL, Zone.INTRA_NODE, Zone.INTER_NODE)
"""Order of the per-zone token counts in a step's totals."""


@dataclass
class StepStats:
    """What one step did, as the rank-0 worker reports it (whole-job totals)."""

    step: int
    """1-based number of the step just finished."""
    loss: float
    tokens: int
    label_tokens: int
    grad_norm: float
    lr: float
    step_seconds: float
    rank_tokens: list[int]
    comm_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes moved per link kind (`intra_node`, `inter_node`) by the whole job
    (modelled: `ray_zep.traffic`)."""
    nic_bytes: list[list[int]] = field(default_factory=list)
    """Bytes that left each NIC, [node][NIC], whole job."""
    compression: dict[str, dict[str, int]] = field(default_factory=dict)
    """With `comm.compression`: per stream (`comm.compression_streams` names), the
    bytes handed to its transfers (`raw_bytes`) and the bytes they sent
    (`wire_bytes`), and the calls that went zipped or plain (`zipped_calls`,
    `plain_calls`), whole job (measured)."""
    moe_aux_loss: float = 0.0
    """Weighted MoE load-balancing loss of the global batch (included in `loss`)."""
    zone_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens of the global batch whose attention stays on one rank (`local`), in a
    node (`intra_node`) or spans nodes (`inter_node`)."""
    model_flops: float = 0.0
    """Forward + backward FLOPs the model needs for the global batch (3 x forward,
    causal attention), whatever the strategy recomputes."""
    rank_flops: list[float] = field(default_factory=list)
    """Each rank's share of `model_flops`: its tokens' layers and its part of the
    attention of every sequence it holds (a ring member, its tokens' share)."""
    memory: dict[str, object] = field(default_factory=dict)
    """Per-rank peak bytes: `modelled` (every step) and `measured` (0 where the step
    was not measured), `measured_by`, and rank 0's modelled and measured `parts`."""
    host: dict[str, list[int]] = field(default_factory=dict)
    """Per rank, at the end of the step: resident memory (`rss_bytes`) and open file
    descriptors (`open_fds`) of its process (`ray_zep.host_usage`)."""
    switcher: dict[str, object] = field(default_factory=dict)
    """First step with `comm.compression=auto`: the costs the job's switch measured at
    start-up and decides on (α and β per collective, codec seconds per byte)."""

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def led_work(shard: RankShard, ctx: StepContext) -> list[float]:
    """Tokens per zone and forward attention FLOPs of the sequences this rank leads
    (the first rank of their group): summed over ranks, each sequence once."""
    zones = [0.0] * len(ZONES)
    rank = ctx.comm.rank
    if shard.plan is None:  # whole sequences on this rank
        zones[0] = float(shard.num_tokens)
        lengths = [int(n) for n in shard.lengths]
    else:
        led = [p for p in shard.plan.placements if p.ranks[0] == rank]
        for p in led:
            zones[ZONES.index(zone_of(p.ranks, ctx.comm.topology))] += p.length
        lengths = [p.length for p in led]
    shape = ctx.model.shape
    return [*zones, sum(shape.attention_flops(n) for n in lengths)]


def rank_model_flops(shard: RankShard, ctx: StepContext) -> float:
    """Forward + backward FLOPs of this rank's share of the step (see `StepStats.rank_flops`)."""
    shape, rank = ctx.model.shape, ctx.comm.rank
    linear = shape.linear_flops_per_token() * shard.num_tokens
    if shard.plan is None:
        attention = sum(shape.attention_flops(int(n)) for n in shard.lengths)
    else:
        held: dict[int, int] = {}
        for fragment in shard.plan.layout(rank):
            held[fragment.seq] = held.get(fragment.seq, 0) + fragment.length
        lengths = {seq: shard.plan.placement(seq).length for seq in held}
        attention = sum(
            shape.attention_flops(lengths[seq]) * tokens / lengths[seq]
            for seq, tokens in held.items()
        )
    return 3.0 * (linear + attention)


def rank_slots(ctx: StepContext, *values: float) -> list[float]:
    """`values` in this rank's slot of one row per value (summed over ranks: gathered)."""
    rows = torch.zeros(len(values), ctx.comm.world_size, dtype=torch.float64)
    rows[:, ctx.comm.rank] = torch.tensor(values, dtype=torch.float64)
    return rows.flatten().tolist()


def modelled_memory(shard: RankShard, ctx: StepContext) -> RankMemory:
    """The memory model's peak for this rank's shard (with the node's shards where the run
    keeps them, `parallel.reshard_to_node`)."""
    ring = 0
    if shard.plan is not None:
        layout = shard.plan.layout(ctx.comm.rank)
        ring = sum(f.end - f.start for f in layout if f.zone is not Zone.LOCAL)
    flash = tiled(ctx.kernel)
    cpu = ctx.device.type == "cpu"
    topology = ctx.comm.topology
    config = with_node_shards(ctx.config, ctx.axes.node_shards)
    inputs = memory_inputs(config, topology, shard.num_tokens, ring, ctx.dtype, flash, cpu)
    return model_memory(ctx.model.shape, inputs)
