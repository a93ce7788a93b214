"""The step of each weights family: gradients, clipping and the step's traffic.

`AutogradRunner` runs one forward and backward through the whole model (FSDP2's
hooks gather and reduce-scatter sharded weights; otherwise the gradients are
all-reduced after backward). `WeightPassingRunner` runs the weight-passing
pipeline shard by shard (`ray_zep.pipeline`), whose gradients land at their
owners. `RUNNERS` maps each family to its runner; the trainer looks it up.

The head computes the token losses inside the model's forward (`OutputHead`),
where FSDP2 has gathered the whole output weight, chunk by chunk of tokens under
`model.loss_chunk_tokens`. The loss of a step is the sum of token cross-entropies
on this rank divided by the number of label tokens of the *global* batch, so summing gradients over
ranks gives exactly the gradient of the global mean loss that the one-process
reference computes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from ray_zep.attention.engine import run_attention
from ray_zep.attention.kernels import AttentionFn, select_backward
from ray_zep.attention.links import Links
from ray_zep.attention.remap_exchange import to_attention, to_linear
from ray_zep.attention.schedule import RankSchedule
from ray_zep.attention.ulysses_chunks import overlapped_attention
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.collectives.adaptive import AdaptiveCollectives
from ray_zep.collectives.ops import all_reduce_sum_
from ray_zep.config import Config
from ray_zep.data.shards import RankShard
from ray_zep.distributed import Comm
from ray_zep.model.llama import Transformer
from ray_zep.moe.parallel import balance_loss
from ray_zep.parallel.axes import Family
from ray_zep.parallel.shard_groups import run_shard_ranks
from ray_zep.remap.layout import RankRemap
from ray_zep.traffic import Traffic, gradient_traffic, sharded_weights_traffic
from ray_zep.train.build import AppliedAxes
from ray_zep.train.reductions import all_reduce_gradients_, square_norm, sum_over_ranks_

Losses = tuple[tuple[float, float], int]
"""(this rank's sum of token losses, its share of the balance loss), bytes all-reduced."""


@dataclass
class StepContext:
    """What a runner works with: the run, the rank's model and its transports."""

    config: Config
    comm: Comm
    device: torch.device
    dtype: torch.dtype
    model: Transformer
    kernel: AttentionFn
    axes: AppliedAxes
    links: Links
    zipped: AdaptiveCollectives | None


class StepRunner:
    """The parts every family shares: the shard's tensors and the autocast."""

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx

    def inputs(self, shard: RankShard) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens, positions and labels of the shard on this rank's device."""
        # Shards arrive read-only from the object store; astype copies them.
        device = self.ctx.device
        tokens = torch.from_numpy(shard.tokens.astype(np.int64)).to(device)
        positions = torch.from_numpy(shard.positions().copy()).to(device)
        labels = torch.from_numpy(shard.labels().copy()).to(device)
        return tokens, positions, labels

    def autocast(self) -> torch.autocast:
        dtype = self.ctx.dtype
        return torch.autocast(self.ctx.device.type, dtype=dtype, enabled=dtype != torch.float32)

    def compute_gradients(self, shard: RankShard) -> Losses:
        raise NotImplementedError

    def clip(self) -> float:
        raise NotImplementedError

    def traffic(self, shard: RankShard, grad_bytes: int) -> Traffic:
        raise NotImplementedError

    def attention_traffic(self, traffic: Traffic, shard: RankShard) -> Traffic:
        """`traffic` plus the shard's attention and remap bytes."""
        if shard.traffic is None:
            return traffic
        scaled, fixed = shard.traffic
        element = torch.empty((), dtype=self.ctx.dtype).element_size()
        return traffic + scaled.times(element) + fixed


class AutogradRunner(StepRunner):
    """One forward and backward through the whole model (replicated, fsdp, hsdp)."""

    def compute_gradients(self, shard: RankShard) -> Losses:
        """Gradients of the global mean loss, summed over ranks, in `.grad`."""
        ctx = self.ctx
        losses = self._forward_backward(shard)
        if ctx.axes.sharded:  # FSDP2 reduce-scattered the gradients during backward
            return losses, 0
        synced = all_reduce_gradients_(ctx.axes.params, ctx.comm, ctx.zipped)
        return losses, synced + ctx.axes.experts.sum_expert_gradients_()

    def clip(self) -> float:
        """Clip by the norm of the whole model's gradient (split experts included)."""
        axes = self.ctx.axes
        max_norm = self.ctx.config.train.grad_clip or float("inf")
        experts = axes.experts.expert_params
        squares = square_norm(axes.params)
        if experts:
            # each EP rank holds other experts: their squares add up over the EP group
            split = square_norm(experts).reshape(1)
            all_reduce_sum_(split, axes.experts.groups.ep, "the expert gradient norm")
            squares = squares + split[0]
        return scale_to_norm([*axes.params, *experts], float(squares.sqrt()), max_norm)

    def traffic(self, shard: RankShard, grad_bytes: int) -> Traffic:
        """Gradient (or FSDP2 gather and reduce-scatter) bytes plus attention and remap."""
        ctx = self.ctx
        if ctx.axes.sharded:
            blocks, other = ctx.axes.unsharded_bytes
            in_node = ctx.axes.node_shards
            again = ctx.config.parallel.reshard_after_forward and not in_node
            traffic = sharded_weights_traffic(
                (2 if again else 1) * blocks + other,
                blocks + other,
                ctx.comm.topology,
                group=run_shard_ranks(ctx.config.parallel, ctx.comm.topology),
                node_gathered=blocks if in_node else 0,
            )
        else:
            traffic = gradient_traffic(grad_bytes, ctx.comm.topology, ctx.comm.world_size)
        return self.attention_traffic(traffic, shard)

    def _forward_backward(self, shard: RankShard) -> tuple[float, float]:
        ctx = self.ctx
        tokens, positions, labels = self.inputs(shard)
        seqs, attention = None, None
        if shard.plan is None:
            seqs = PackedSeqs.from_lengths(shard.lengths, ctx.device)
        else:
            attention = self._engine(shard)
        # the routing groups stay set through backward: checkpointed blocks route again
        moe_layers = ctx.model.moe_layers()
        for moe in moe_layers:
            moe.routing_groups = shard.routing_groups
        try:
            with self.autocast():
                # the head computes the loss (chunked under model.loss_chunk_tokens)
                token_losses = ctx.model(tokens, positions, seqs, attention, labels_T=labels)
            coef = ctx.config.model.moe.aux_loss_coef
            aux = balance_loss(ctx.model.balance(), ctx.comm, coef).to(ctx.device)
            (token_losses / max(1, shard.global_label_tokens) + aux).backward()
        finally:
            for moe in moe_layers:
                moe.routing_groups = None
        return float(token_losses.detach()), float(aux.detach())

    def _engine(self, shard: RankShard) -> AttentionFn:
        """Attention through the engine for this shard's plan (metadata built once per step).

        With a remap, q/k/v arrive on the linear layout, move to the attention
        layout for the engine, and the output moves back. Under
        `parallel.ulysses_chunks` > 1 the callable also offers `around_projections`
        (`EngineAttention`).
        """
        ctx = self.ctx
        schedule = RankSchedule.build(shard.plan, ctx.comm.rank, ctx.device, shard.routing)
        kernels = (ctx.kernel, select_backward(ctx.kernel))
        chunks = ctx.config.parallel.ulysses_pieces
        return EngineAttention(schedule, ctx.links, kernels, shard.remap, chunks)


class EngineAttention:
    """The attention engine as the model calls it: `(q_THE, k_TKE, v_TKE, seqs)` ->
    (out_THE, None), and, where this rank holds a USP item, no remap moves its rows and
    `chunks` > 1, `around_projections(x_TD, rope, inputs, output)`: the block's
    attention output projected, its USP items' head exchanges in `chunks` pieces beside
    the projections (`ray_zep.attention.ulysses_chunks`)."""

    def __init__(self, schedule: RankSchedule, links: Links, kernels, remap, chunks: int):
        self.schedule, self.links, self.kernels = schedule, links, kernels
        self.remap, self.ops = remap, Counter()
        usp = any(item.item.ulysses > 1 for item in schedule.items)
        self.chunks = chunks if usp and remap is None else 1

    def __call__(self, q_THE, k_TKE, v_TKE, seqs, causal=True):
        links, remap, ops = self.links, self.remap, self.ops
        if remap is not None:
            q_THE, k_TKE, v_TKE = _remap_qkv(q_THE, k_TKE, v_TKE, remap, links, ops)
        out_THE = run_attention(q_THE, k_TKE, v_TKE, self.schedule, links, self.kernels)
        if remap is not None:
            out_THE = to_linear(out_THE.flatten(1), remap, links, ops).unflatten(
                1, out_THE.shape[1:]
            )
        return out_THE, None

    @property
    def around_projections(self):
        """None where the exchanges run whole (see the class)."""
        if self.chunks == 1:
            return None

        def attend(x_TD, rope, inputs, output):
            return overlapped_attention(x_TD, rope, inputs, output, self.schedule, self.links,
                                        self.kernels, self.chunks)  # fmt: skip

        return attend


class WeightPassingRunner(StepRunner):
    """The weight-passing pipeline (tawpipe, ring_relay): gradients land at the owners."""

    def compute_gradients(self, shard: RankShard) -> Losses:
        tokens, positions, labels = self.inputs(shard)
        seqs = PackedSeqs.from_lengths(shard.lengths, self.ctx.device)
        loss_sum = self.ctx.axes.pipeline.forward_backward(
            tokens, positions, seqs, labels, shard.global_label_tokens, self.autocast()
        )
        return (loss_sum, 0.0), 0

    def clip(self) -> float:
        """Every parameter has one owner: the whole norm is the sum over owners."""
        params = self.ctx.axes.params
        max_norm = self.ctx.config.train.grad_clip or float("inf")
        squares = square_norm(params).reshape(1)
        sum_over_ranks_(squares, self.ctx.comm, "the gradient norm")
        return scale_to_norm(params, float(squares.sqrt()), max_norm)

    def traffic(self, shard: RankShard, grad_bytes: int) -> Traffic:
        """The shards and their gradients (the same every step)."""
        return self.ctx.axes.pipeline.step_traffic


RUNNERS: dict[Family, type[StepRunner]] = {
    Family.AUTOGRAD: AutogradRunner,
    Family.WEIGHT_PASSING: WeightPassingRunner,
}


def scale_to_norm(params: list[torch.nn.Parameter], norm: float, max_norm: float) -> float:
    """Scale the gradients so their whole norm `norm` is at most `max_norm`; returns `norm`."""
    scale = min(1.0, max_norm / (norm + 1e-6))
    if scale < 1.0:
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], scale)
    return norm


def _remap_qkv(q_THE, k_TKE, v_TKE, remap: RankRemap, links: Links, ops: Counter):
    """q, k and v from the linear to the attention layout, in one transfer."""
    widths = [q_THE[0].numel(), k_TKE[0].numel(), v_TKE[0].numel()]
    rows = torch.cat((q_THE.flatten(1), k_TKE.flatten(1), v_TKE.flatten(1)), dim=1)
    moved = to_attention(rows, remap, links, ops).split(widths, dim=1)
    return tuple(
        part.unflatten(1, x.shape[1:]) for part, x in zip(moved, (q_THE, k_TKE, v_TKE), strict=True)
    )
