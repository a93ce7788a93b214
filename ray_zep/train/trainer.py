"""One rank's training state and step.

The loss of a step is the sum of token cross-entropies on this rank divided by
the number of label tokens of the *global* batch, so summing gradients over
ranks gives exactly the gradient of the global mean loss that `single`
computes in one process.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ray_zep.attention.engine import run_attention
from ray_zep.attention.kernels import (
    AttentionFn,
    flash_varlen_attention,
    select_backward,
    select_kernel,
)
from ray_zep.attention.links import Links
from ray_zep.attention.schedule import RankSchedule
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.collectives.adaptive import AdaptiveCollectives
from ray_zep.collectives.comms import all_reduce_sum_ as group_all_reduce_sum_
from ray_zep.config import Compression, Config, Device, Precision
from ray_zep.constants import IGNORE_INDEX
from ray_zep.data.shards import RankShard
from ray_zep.dist import Comm, GroupNeeds
from ray_zep.errors import ConfigError
from ray_zep.model.llama import Transformer
from ray_zep.model.shapes import build_shape
from ray_zep.moe.parallel import balance_loss, parallelize_experts
from ray_zep.parallel.axes import Family, Passing, Sharding
from ray_zep.parallel.fsdp import mesh_shape, shard_model
from ray_zep.parallel.memory import RankMemory
from ray_zep.partition.plan import Zone, zone_of
from ray_zep.pipeline.runner import WeightPipeline
from ray_zep.remap.comms import to_attention, to_linear
from ray_zep.remap.layout import RankRemap
from ray_zep.routing.comms import open_channels
from ray_zep.traffic import Traffic, gradient_traffic, sharded_weights_traffic
from ray_zep.train import checkpoint
from ray_zep.train.comms import all_reduce_gradients_, all_reduce_sum_, square_norm
from ray_zep.train.memory_probe import PeakProbe, modelled
from ray_zep.train.optim import build_optimizer, lr_at, set_lr

log = logging.getLogger(__name__)


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
    compression: dict[str, int] = field(default_factory=dict)
    """With `comm.compression`: bytes handed to the gradient collectives (`raw_bytes`)
    and bytes they sent (`wire_bytes`), whole job (measured)."""
    moe_aux_loss: float = 0.0
    """Weighted MoE load-balancing loss of the global batch (included in `loss`)."""
    zone_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens of the global batch whose attention stays on one rank (`local`), in a
    node (`intra_node`) or spans nodes (`inter_node`)."""
    model_flops: float = 0.0
    """Forward + backward FLOPs the model needs for the global batch (3 x forward,
    causal attention), whatever the strategy recomputes."""
    memory: dict[str, object] = field(default_factory=dict)
    """Per-rank peak bytes: `modelled` (every step) and `measured` (0 where the step
    was not measured), `measured_by`, and rank 0's modelled and measured `parts`."""

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def _remap_qkv(q_THE, k_TKE, v_TKE, remap: RankRemap, links: Links, ops: Counter):
    """q, k and v from the linear to the attention layout, in one transfer."""
    widths = [q_THE[0].numel(), k_TKE[0].numel(), v_TKE[0].numel()]
    rows = torch.cat((q_THE.flatten(1), k_TKE.flatten(1), v_TKE.flatten(1)), dim=1)
    moved = to_attention(rows, remap, links, ops).split(widths, dim=1)
    return tuple(
        part.unflatten(1, x.shape[1:]) for part, x in zip(moved, (q_THE, k_TKE, v_TKE), strict=True)
    )


def _parameter_bytes(model: Transformer, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of the transformer blocks' parameters and of the others, in `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    blocks = sum(p.numel() for p in model.layers.parameters()) * size
    return blocks, sum(p.numel() for p in model.parameters()) * size - blocks


def _scale_to_norm(params: list[torch.nn.Parameter], norm: float, max_norm: float) -> float:
    """Scale the gradients so their whole norm `norm` is at most `max_norm`; returns `norm`."""
    scale = min(1.0, max_norm / (norm + 1e-6))
    if scale < 1.0:
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], scale)
    return norm


def resolve_device(device: Device) -> torch.device:
    """`train.device` on this process: auto picks CUDA when it is available."""
    if device is Device.CPU or (device is Device.AUTO and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("config key train.device=cuda: no CUDA device is visible to this process")
    return torch.device("cuda", torch.cuda.current_device())


def resolve_dtype(precision: Precision, device: torch.device) -> torch.dtype:
    """Compute dtype: fp32 on CPU, bf16 autocast on GPU unless `train.precision` says otherwise."""
    if precision is Precision.FP32 or (precision is Precision.AUTO and device.type == "cpu"):
        return torch.float32
    if device.type == "cpu":
        raise ConfigError(
            "config key train.precision=bf16: bf16 autocast is for GPU runs; use fp32"
        )
    return torch.bfloat16


def group_needs(config: Config) -> GroupNeeds:
    """The process groups a run needs besides the world group."""
    weights = config.parallel.weights_axis
    return GroupNeeds(
        node_and_rail=weights.passing is Passing.GROUPED,
        fsdp=mesh_shape(config.parallel),
        routing=config.parallel.routing,
        ep=config.parallel.ep,
    )


def _zipped_collectives(config: Config, comm: Comm) -> AdaptiveCollectives | None:
    """The gradient collectives' switcher when `comm.compression` is on (collective call)."""
    mode = config.comm.compression
    if mode is Compression.OFF or comm.group is None or not config.comm.compression_streams:
        return None
    return AdaptiveCollectives(comm.world, mode, config.comm.compression_refresh_calls)


class RankTrainer:
    """Model, optimizer and step of one rank.

    Args:
        config: the run's config.
        comm: this rank's process group and topology.
        device: compute device of this rank.
    """

    def __init__(self, config: Config, comm: Comm, device: torch.device) -> None:
        self.config = config
        self.comm = comm.with_groups(group_needs(config))
        self.device = device
        self.dtype = resolve_dtype(config.train.precision, device)
        shape = build_shape(config.model)
        self.kernel = select_kernel(config.model.attention_kernel, device, self.dtype)
        self.model = Transformer(shape, self.kernel)
        self.linear_flops = shape.linear_flops_per_token()
        """Forward matmul FLOPs of one token (for the step's model FLOPs)."""
        self.model.init_weights(torch.Generator().manual_seed(config.train.seed))
        self.model.to(device)
        self.model.set_checkpointing(config.train.activation_checkpointing)
        self.shape = shape
        self.experts = parallelize_experts(self.model, self.comm, config)
        self.pipeline: WeightPipeline | None = None
        self.state_module: torch.nn.Module = self.model
        """What this rank checkpoints and optimizes: the model, or its own weight shard."""
        self.sharded = bool(config.parallel.weights_axis.fsdp and self.comm.distributed)
        """Parameters, gradients and optimizer state sharded by FSDP2."""
        self.unsharded_bytes = _parameter_bytes(self.model, self.dtype)
        """(block, other) bytes of the whole model's parameters in the compute dtype."""
        if self.sharded:
            split = [m.experts for m in self.model.moe_layers()] if self.experts.groups else []
            shard_model(self.model, self.comm, config.parallel, device, self.dtype, split)
            # fully_shard replaced the parameters with sharded ones
            self.experts.expert_params = [p for m in split for p in m.parameters()]
        split_ids = {id(p) for p in self.experts.expert_params}
        self.params = [
            p for p in self.model.parameters() if p.requires_grad and id(p) not in split_ids
        ]
        """Parameters whose gradients are summed over all ranks (all but split experts)."""
        if config.parallel.weights_axis.family is Family.WEIGHT_PASSING:
            self.pipeline = WeightPipeline(
                self.model, self.comm, config.parallel.weights, config.parallel.shard_recompute
            )
            self.params = self.pipeline.weights.own_parameters()
            self.state_module = self.pipeline.weights.own_module()
        self.optimizer = build_optimizer(self.state_module, config.train)
        self.steps_done = 0
        self.memory_probe = PeakProbe(
            device, config.metrics.memory_every, (self.state_module, self.optimizer)
        )
        self.zipped = _zipped_collectives(config, self.comm)
        ring_zip = None
        if self.zipped is not None and "kv" in config.comm.compression_streams:
            ring_zip = self.zipped.ring_zipper()
        routing = open_channels(self.comm) if config.parallel.routing and comm.distributed else None
        self.links = Links(self.comm, routing, ring_zip)
        """What the attention engine and the remap communicate over."""

    def train_step(self, shard: RankShard) -> StepStats:
        """Forward, backward, gradient sync, clip and update on this rank's shard."""
        started = time.perf_counter()
        lr = lr_at(self.steps_done, self.config.train)
        set_lr(self.optimizer, lr)
        with self.memory_probe.step(self.steps_done + 1):
            (loss_sum, aux_loss), grad_bytes = self.compute_gradients(shard)
            grad_norm = self._clip()
            self.optimizer.step()
        self.steps_done += 1
        ring_bytes = self.links.ring_zip.take() if self.links.ring_zip else (0, 0)
        led = self._led_work(shard)
        model = self._modelled_memory(shard)
        memory = self._rank_slots(model.total, self.memory_probe.last.get("peak", 0.0))
        totals = torch.tensor([loss_sum, aux_loss, *ring_bytes, *led, *memory], dtype=torch.float64)
        all_reduce_sum_(totals, self.comm, "the step loss")
        zone_tokens, attention_flops = totals[4:7].tolist(), float(totals[7])
        per_rank = totals[8:].view(2, -1).tolist()
        traffic = self._traffic(shard, grad_bytes)
        return StepStats(
            step=self.steps_done,
            loss=float(totals[0]) / max(1, shard.global_label_tokens) + float(totals[1]),
            tokens=shard.global_tokens,
            label_tokens=shard.global_label_tokens,
            grad_norm=grad_norm,
            lr=lr,
            step_seconds=time.perf_counter() - started,
            rank_tokens=list(shard.rank_tokens),
            comm_bytes={"intra_node": traffic.intra_node, "inter_node": traffic.inter_node},
            nic_bytes=traffic.nic.tolist(),
            compression=self._compression_bytes(int(totals[2]), int(totals[3])),
            moe_aux_loss=float(totals[1]),
            zone_tokens={z.value: int(n) for z, n in zip(ZONES, zone_tokens, strict=True)},
            model_flops=3.0 * (self.linear_flops * shard.global_tokens + attention_flops),
            memory={
                "modelled": per_rank[0],
                "measured": per_rank[1],
                "measured_by": self.memory_probe.method,
                "parts": {"modelled": model.to_dict(), "measured": self.memory_probe.last},
            },
        )

    def _rank_slots(self, *values: float) -> list[float]:
        """`values` in this rank's slot of one row per value (summed over ranks: gathered)."""
        rows = torch.zeros(len(values), self.comm.world_size, dtype=torch.float64)
        rows[:, self.comm.rank] = torch.tensor(values, dtype=torch.float64)
        return rows.flatten().tolist()

    def _modelled_memory(self, shard: RankShard) -> RankMemory:
        ring = 0
        if shard.plan is not None:
            layout = shard.plan.layout(self.comm.rank)
            ring = sum(f.end - f.start for f in layout if f.zone is not Zone.LOCAL)
        flash = self.kernel is flash_varlen_attention
        return modelled(
            self.config, self.shape, self.comm.topology, shard.num_tokens, ring, self.dtype, flash
        )

    def _led_work(self, shard: RankShard) -> list[float]:
        """Tokens per zone and forward attention FLOPs of the sequences this rank
        leads (the first rank of their group): summed over ranks, each sequence once."""
        zones = [0.0] * len(ZONES)
        if shard.plan is None:  # whole sequences on this rank
            zones[0] = float(shard.num_tokens)
            lengths = [int(n) for n in shard.lengths]
        else:
            led = [p for p in shard.plan.placements if p.ranks[0] == self.comm.rank]
            for p in led:
                zones[ZONES.index(zone_of(p.ranks, self.comm.topology))] += p.length
            lengths = [p.length for p in led]
        shape = self.model.shape
        attention = sum(shape.attention_flops(n) for n in lengths)
        return [*zones, attention]

    def _compression_bytes(self, ring_raw: int, ring_wire: int) -> dict[str, int]:
        """Whole-job bytes of the compressible transfers of the step (measured)."""
        if self.zipped is None:
            return {}
        sizes = self.zipped.take_sizes()
        return {
            "raw_bytes": sizes.raw_bytes + ring_raw,
            "wire_bytes": sizes.wire_bytes + ring_wire,
        }

    def _traffic(self, shard: RankShard, grad_bytes: int) -> Traffic:
        """Bytes of this step: gradients plus the shard's attention and remap traffic
        (weight-passing strategies: the shards and their gradients)."""
        if self.pipeline is not None:
            return self.pipeline.step_traffic
        if self.sharded:
            blocks, other = self.unsharded_bytes
            gathers = 2 if self.config.parallel.reshard_after_forward else 1
            traffic = sharded_weights_traffic(
                gathers * blocks + other,
                blocks + other,
                self.comm.topology,
                hybrid=self.config.parallel.weights_axis.sharding is Sharding.NODE,
            )
        else:
            traffic = gradient_traffic(grad_bytes, self.comm.topology, self.comm.world_size)
        if shard.traffic is not None:
            scaled, fixed = shard.traffic
            element = torch.empty((), dtype=self.dtype).element_size()
            traffic = traffic + scaled.times(element) + fixed
        return traffic

    def compute_gradients(self, shard: RankShard) -> tuple[tuple[float, float], int]:
        """Gradients of the global mean loss, summed over ranks, in `.grad`.

        Returns:
            This rank's sum of token losses and share of the balance loss, and
            the bytes all-reduced.
        """
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipeline is not None:
            return (self._pipelined_forward_backward(shard), 0.0), 0
        losses = self._forward_backward(shard)
        if self.sharded:  # FSDP2 reduce-scattered the gradients during backward
            return losses, 0
        zipped = self.zipped if "gradients" in self.config.comm.compression_streams else None
        synced = all_reduce_gradients_(self.params, self.comm, zipped)
        return losses, synced + self.experts.sum_expert_gradients_()

    def _inputs(self, shard: RankShard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens, positions and labels of the shard on this rank's device."""
        # Shards arrive read-only from the object store; astype copies them.
        tokens = torch.from_numpy(shard.tokens.astype(np.int64)).to(self.device)
        positions = torch.from_numpy(shard.positions().copy()).to(self.device)
        labels = torch.from_numpy(shard.labels().copy()).to(self.device)
        return tokens, positions, labels

    def _autocast(self) -> torch.autocast:
        return torch.autocast(
            self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32
        )

    def _forward_backward(self, shard: RankShard) -> tuple[float, float]:
        tokens, positions, labels = self._inputs(shard)
        seqs, attention = None, None
        if shard.plan is None:
            seqs = PackedSeqs.from_lengths(shard.lengths, self.device)
        else:
            attention = self._engine(shard)
        # the routing groups stay set through backward: checkpointed blocks route again
        for moe in self.model.moe_layers():
            moe.routing_groups = shard.routing_groups
        try:
            with self._autocast():
                logits_TV = self.model(tokens, positions, seqs, attention)
            token_losses = F.cross_entropy(
                logits_TV.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum"
            )
            coef = self.config.model.moe.aux_loss_coef
            aux = balance_loss(self.model.balance(), self.comm, coef).to(self.device)
            (token_losses / max(1, shard.global_label_tokens) + aux).backward()
        finally:
            for moe in self.model.moe_layers():
                moe.routing_groups = None
        return float(token_losses.detach()), float(aux.detach())

    def _pipelined_forward_backward(self, shard: RankShard) -> float:
        """The step under a weight-passing strategy: gradients land at the shard owners."""
        tokens, positions, labels = self._inputs(shard)
        seqs = PackedSeqs.from_lengths(shard.lengths, self.device)
        return self.pipeline.forward_backward(
            tokens, positions, seqs, labels, shard.global_label_tokens, self._autocast()
        )

    def _engine(self, shard: RankShard) -> AttentionFn:
        """Attention through the engine for this shard's plan (metadata built once per step).

        With a remap, q/k/v arrive on the linear layout, move to the attention
        layout for the engine, and the output moves back.
        """
        schedule = RankSchedule.build(shard.plan, self.comm.rank, self.device, shard.routing)
        kernels = (self.kernel, select_backward(self.kernel))
        links, remap, ops = self.links, shard.remap, Counter()

        def attention(q_THE, k_TKE, v_TKE, seqs, causal=True):
            if remap is not None:
                q_THE, k_TKE, v_TKE = _remap_qkv(q_THE, k_TKE, v_TKE, remap, links, ops)
            out_THE = run_attention(q_THE, k_TKE, v_TKE, schedule, links, kernels)
            if remap is not None:
                out_THE = to_linear(out_THE.flatten(1), remap, links, ops).unflatten(
                    1, out_THE.shape[1:]
                )
            return out_THE, None

        return attention

    def _clip(self) -> float:
        """Clip by the norm of the whole model's gradient (split experts included)."""
        max_norm = self.config.train.grad_clip or float("inf")
        experts = self.experts.expert_params
        if self.pipeline is not None:
            # every parameter has one owner: the whole norm is the sum over owners
            squares = square_norm(self.params).reshape(1)
            all_reduce_sum_(squares, self.comm, "the gradient norm")
            return _scale_to_norm(self.params, float(squares.sqrt()), max_norm)
        squares = square_norm(self.params)
        if experts:
            # each EP rank holds other experts: their squares add up over the EP group
            split = square_norm(experts).reshape(1)
            group_all_reduce_sum_(split, self.experts.groups.ep, "the expert gradient norm")
            squares = squares + split[0]
        return _scale_to_norm([*self.params, *experts], float(squares.sqrt()), max_norm)

    def save(self, run_dir: Path, cursor: dict[str, int]) -> Path:
        """Checkpoint the state after `steps_done` steps (collective)."""
        path = checkpoint.checkpoint_path(run_dir, self.steps_done)
        checkpoint.save_checkpoint(
            path,
            self.state_module,
            self.optimizer,
            checkpoint.Progress(self.steps_done, cursor),
            self.comm,
            own_shard=self.pipeline is not None,
        )
        return path

    def load(self, path: Path) -> checkpoint.Progress:
        """Restore a checkpoint (collective); training continues after its step."""
        progress = checkpoint.load_checkpoint(
            path, self.state_module, self.optimizer, self.comm, own_shard=self.pipeline is not None
        )
        self.steps_done = progress.step
        return progress
