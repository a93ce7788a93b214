"""Expert parallelism for a whole model: groups, sharding, gradient sum, balance loss.

Ranks r, r+1, ..., r+ep-1 (r a multiple of `parallel.ep`) form an EP group and
split every MoE block's experts between them; with ep <= GPUs per node the
group lies inside a node. Ranks holding the same experts (one per EP group)
form a replica group, over which those experts' gradients are summed; every
other parameter is summed over all ranks as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ray_zep.collectives.ops import (
    all_reduce_sum_,
    gradients_or_zeros,
    reduce_in_one_buffer_,
)
from ray_zep.collectives.switches import CompressionSwitches
from ray_zep.config import Config, MoEDispatch, MoEPipeline
from ray_zep.distributed import Comm
from ray_zep.distributed.group import Group
from ray_zep.errors import ConfigError
from ray_zep.moe.dispatch import ExpertLink
from ray_zep.moe.gate import Balance
from ray_zep.moe.layer import MoE, shard_experts
from ray_zep.moe.pipeline import FoldedForward

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's EP group and the group of ranks holding the same experts.

    Attributes:
        ep: the ranks that split the experts between them.
        replicas: the ranks that hold the same experts (None: just this one).
    """

    ep: Group
    replicas: Group | None

    @classmethod
    def build(cls, comm: Comm, ep: int, experts: int) -> ExpertGroups:
        """This rank's EP and replica groups, from those the Comm was built with.

        Raises:
            ConfigError: ep does not divide the ranks or the experts (the message
                prints every factor), or the Comm has no EP groups.
        """
        world = comm.world_size
        if world % ep or experts % ep:
            raise ConfigError(
                f"config key parallel.ep={ep}: must divide the {world} ranks (topology.nodes="
                f"{comm.topology.nodes} x topology.gpus_per_node={comm.topology.gpus_per_node}) "
                f"and model.moe.num_experts={experts}"
            )
        if comm.groups.ep is None or comm.groups.ep.size != ep:
            raise ConfigError(f"parallel.ep={ep}: the Comm was built without EP groups of {ep}")
        return cls(comm.groups.ep, comm.groups.ep_replicas)


@dataclass
class ExpertParallel:
    """What `parallelize_experts` did to a model.

    Attributes:
        groups: the process groups (None: experts are not split).
        expert_params: parameters whose gradients are summed over `groups.replicas`
            only (empty when experts are not split).
    """

    groups: ExpertGroups | None
    expert_params: list[nn.Parameter]

    def sum_expert_gradients_(self) -> int:
        """Sum the split experts' gradients over their replicas; bytes all-reduced."""
        grads = gradients_or_zeros(self.expert_params)
        replicas = self.groups.replicas if self.groups else None
        if not grads or replicas is None:
            return 0
        return reduce_in_one_buffer_(
            grads, lambda flat: all_reduce_sum_(flat, replicas, "expert gradients")
        )


def parallelize_experts(
    model: nn.Module, comm: Comm, config: Config, switches: CompressionSwitches | None = None
) -> ExpertParallel:
    """Configure every MoE block of `model` for this run (collective when ep > 1).

    With `switches` (`comm.compression` on), the dispatch and combine go through the
    EP group's switch (`ray_zep.moe.dispatch.ExpertLink`).

    Sets the dispatch and the capacity (`train.tokens_per_rank` tokens per
    routing group), splits the experts over `parallel.ep` ranks, and gives the
    MoE blocks the FoldMoE forward when `parallel.moe_pipeline` is on.
    """
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    ep = config.parallel.ep
    if not layers:
        if ep > 1 or config.parallel.moe_pipeline is not MoEPipeline.NONE:
            raise ConfigError(
                f"config keys parallel.ep={ep} / parallel.moe_pipeline="
                f"{config.parallel.moe_pipeline.value} need an MoE model: set "
                "model.moe.num_experts or an MoE model.preset (tiny_moe, gpt_moe_m, ...)"
            )
        return ExpertParallel(None, [])
    # capacity per rank's tokens (L), as the reference routes the mirrored ranks' groups;
    # a reference that mirrors no run routes the whole batch as one group, sized for it
    one_group = config.parallel.sequence_axis.one_process and not config.parallel.reference_layout
    for moe in layers:
        moe.dispatch = _dispatch(config, moe)
        moe.capacity_tokens = None if one_group else config.train.tokens_per_rank
    parallel = config.parallel
    slicing = parallel.moe_pipeline in (MoEPipeline.AAAM, MoEPipeline.ONE_A_ONE_M)
    if slicing and not parallel.sequence_axis.local_attention_only and comm.rank == 0:
        log.info(
            "parallel.moe_pipeline=%s: parallel.sequence=%s spreads attention over ranks, so "
            "MoE blocks overlap only their MoE micro-batches (as moe_only)",
            parallel.moe_pipeline.value,
            parallel.sequence.value,
        )
    if parallel.moe_pipeline is not MoEPipeline.NONE:
        pipeline = FoldedForward(
            parallel.moe_pipeline, parallel.moe_overlap_degree, parallel.moe_uniform_slicing
        )
        for block in model.modules():
            if isinstance(getattr(block, "feed_forward", None), MoE):
                block.pipeline = pipeline
    if ep == 1 or not comm.distributed:
        return ExpertParallel(None, [])
    groups = ExpertGroups.build(comm, ep, layers[0].num_experts)
    link = ExpertLink(groups.ep, switches.for_group(groups.ep) if switches else None)
    for moe in layers:
        shard_experts(moe, link)
    return ExpertParallel(groups, [p for moe in layers for p in moe.experts.parameters()])


def _dispatch(config: Config, moe: MoE) -> MoEDispatch:
    wanted = config.model.moe.dispatch
    if wanted is MoEDispatch.AUTO:
        return MoEDispatch.PADDED if moe.capacity_factor > 0 else MoEDispatch.VARLEN
    return wanted


def balance_loss(balance: list[Balance], comm: Comm, coef: float) -> torch.Tensor:
    """This rank's share of the whole batch's load-balancing loss, times `coef`.

    Uses the first-choice counts and token counts of the whole job (one small
    all-reduce for all blocks), so summing the shares over ranks gives the loss
    and the gradients `single` computes on the global batch.
    """
    if not balance or coef == 0:
        return torch.zeros(())
    counts = torch.stack([b.first_counts_X.float().cpu() for b in balance])
    tokens = torch.tensor([float(b.tokens) for b in balance]).unsqueeze(1)
    totals = torch.cat((counts, tokens), dim=1).double()
    if comm.distributed:
        work = dist.all_reduce(totals, group=comm.group, async_op=True)
        comm.wait([work], "all-reduce of MoE routing counts")
    loss = sum(
        b.loss(row[:-1].to(b.prob_sum_X), int(row[-1]))
        for b, row in zip(balance, totals, strict=True)
    )
    return coef * loss
