"""Mixture-of-Experts feed-forward layer: top-k gate, capacity, SwiGLU experts.

Plain PyTorch; runs in one process with all experts. `shard_experts` turns it
into one rank's part under expert parallelism: the rank keeps its experts'
weights and moves tokens with `moe.dispatch`. The result per token is the same
either way, because gating and capacity are decided per rank (one routing
group) before anything moves.

Legend: T tokens, D model dim, F expert hidden dim, X experts, X_l local
experts, K choices per token, C capacity, N kept choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ray_zep.config import MoEDispatch as Dispatch
from ray_zep.distributed.group import Group
from ray_zep.errors import ConfigError, PlacementError
from ray_zep.lean_ops import swiglu
from ray_zep.moe import dispatch
from ray_zep.moe.gate import Balance, Routing, RoutingGroups, expert_capacity, route


class Experts(nn.Module):
    """The SwiGLU weights of a block's experts (this rank's share under EP).

    Args:
        experts: X (or X_l under expert parallelism).
        hidden: F.
        dim: D.
    """

    def __init__(self, experts: int, hidden: int, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))

    def forward(self, rows_ND: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Expert j on the j-th run of `sizes[j]` rows (rows sorted by expert).

        One call runs every expert, so a sharding wrapper (FSDP2) gathers the
        weights once per call.
        """
        parts = rows_ND.split(sizes)
        outs = [self._one(x_ND, j) for j, x_ND in enumerate(parts)]
        return torch.cat(outs) if outs else rows_ND

    def _one(self, x_ND: torch.Tensor, j: int) -> torch.Tensor:
        w1, w3, w2 = self.w1[j], self.w3[j], self.w2[j]
        return F.linear(swiglu(F.linear(x_ND, w1), F.linear(x_ND, w3)), w2)


class MoE(nn.Module):
    """Top-k MoE over SwiGLU experts.

    Args:
        dim: D.
        hidden: F, each expert's hidden size.
        experts: X.
        top_k: choices per token (1 or 2).
        capacity_factor: slots per expert = ceil(CF · K · T / X); <= 0: no drops.
        dispatch: how tokens reach the experts (AUTO: padded with a capacity
            factor, varlen when dropless).
        capacity_tokens: T of the capacity formula; None: the tokens of each call.
            Capacity-padded dispatch over several ranks needs the same capacity on
            every rank, so it needs this (e.g. `train.tokens_per_rank`).
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        experts: int,
        top_k: int = 1,
        capacity_factor: float = 1.0,
        dispatch: Dispatch = Dispatch.PADDED,
        capacity_tokens: int | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        if dispatch is Dispatch.AUTO:
            dispatch = Dispatch.PADDED if capacity_factor > 0 else Dispatch.VARLEN
        self.dispatch, self.capacity_tokens = dispatch, capacity_tokens
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = Experts(experts, hidden, dim)
        self.ep: dispatch.ExpertLink | None = None
        self.first_expert = 0
        self.balance: Balance | None = None
        """Load-balancing statistics of the last forward (its routing groups)."""
        self.routing_groups: RoutingGroups | None = None
        """Routing groups of the next forward (None: all its tokens form one group)."""

    @property
    def aux_loss(self) -> torch.Tensor:
        """Balance loss of the last forward's routing group alone."""
        return self.balance.loss() if self.balance is not None else torch.zeros(())

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        groups = self.routing_groups
        if groups is None:
            return self._route_group(x_TD)
        order_T = torch.as_tensor(groups.order, dtype=torch.int64, device=x_TD.device)
        outs, balance = [], None
        for part_TD in x_TD[order_T].split(list(groups.sizes)):
            outs.append(self._route_group(part_TD))
            balance = self.balance if balance is None else balance + self.balance
        self.balance = balance
        return x_TD.new_zeros(x_TD.shape).index_copy(0, order_T, torch.cat(outs))

    def _route_group(self, x_TD: torch.Tensor) -> torch.Tensor:
        """One routing group: gate, capacity, dispatch, experts, combine."""
        capacity = self.capacity(x_TD.shape[0])
        routing = route(self.gate(x_TD), self.top_k, capacity)
        self.balance = routing.balance
        if self.dispatch is Dispatch.PADDED:
            return self._padded(x_TD, routing, capacity)
        return self._varlen(x_TD, routing)

    def capacity(self, tokens: int) -> int:
        """Slots per expert for a call on `tokens` tokens."""
        if self.capacity_tokens is None or (
            self.capacity_factor <= 0 and self.dispatch is Dispatch.VARLEN
        ):
            return expert_capacity(tokens, self.num_experts, self.top_k, self.capacity_factor)
        if self.capacity_factor <= 0 and tokens > self.capacity_tokens:
            raise PlacementError(
                f"a rank holds {tokens} tokens, more than the {self.capacity_tokens} the "
                "dropless capacity-padded MoE was sized for; raise capacity_tokens"
            )
        return expert_capacity(
            self.capacity_tokens, self.num_experts, self.top_k, self.capacity_factor
        )

    def sharded_parameter_names(self) -> dict[str, str]:
        """Parameters that differ between EP ranks, with a name unique to this shard."""
        if self.ep is None:
            return {}
        last = self.first_expert + self.experts.w1.shape[0] - 1
        return {
            f"experts.{name}": f"experts.{name}.experts_{self.first_expert}_{last}"
            for name in ("w1", "w3", "w2")
        }

    def _padded(self, x_TD: torch.Tensor, routing: Routing, capacity: int) -> torch.Tensor:
        kept, token_N = routing.kept_TK, _kept_tokens(routing)
        buf_XCD = x_TD.new_zeros((self.num_experts, capacity, x_TD.shape[1]))
        buf_XCD = buf_XCD.index_put((routing.expert_TK[kept], routing.slot_TK[kept]), x_TD[token_N])
        if self.ep is None:
            sizes = [capacity] * self.num_experts
            out_XCD = self.experts(buf_XCD.flatten(0, 1), sizes).view(buf_XCD.shape)
        else:
            out_XCD = dispatch.padded_experts(buf_XCD, self.experts, self.ep)
        picked_TKD = out_XCD[routing.expert_TK, routing.slot_TK.clamp_min(0)]
        return (picked_TKD * routing.weight_TK.unsqueeze(-1).to(x_TD.dtype)).sum(1)

    def _varlen(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        choices = SortedChoices.of(routing)
        rows_ND = x_TD[choices.token_N]
        if self.ep is None:
            out_ND = self.all_experts(rows_ND, routing.counts_X)
        else:
            out_ND = dispatch.varlen_experts(rows_ND, routing.counts_X, self.experts, self.ep)
        return choices.combine(out_ND, x_TD)

    def all_experts(self, rows_ND: torch.Tensor, counts_X: torch.Tensor) -> torch.Tensor:
        """Every expert (all held here) on rows sorted by expert, counts_X rows each."""
        return self.experts(rows_ND, counts_X.tolist())


@dataclass(frozen=True)
class SortedChoices:
    """The kept choices of a routing, sorted by expert (the variable-split order).

    Attributes:
        token_N: token of each kept choice.
        weight_N: its gate weight (float32).
    """

    token_N: torch.Tensor
    weight_N: torch.Tensor

    @classmethod
    def of(cls, routing: Routing) -> SortedChoices:
        kept = routing.kept_TK
        order = torch.argsort(routing.expert_TK[kept], stable=True)
        return cls(_kept_tokens(routing)[order], routing.weight_TK[kept][order])

    def combine(self, out_ND: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        """Σ over a token's kept choices of weight · expert output: (T, D) like x_TD."""
        weighted = out_ND * self.weight_N.unsqueeze(-1).to(out_ND.dtype)
        return x_TD.new_zeros(x_TD.shape).index_add(0, self.token_N, weighted.to(x_TD.dtype))


def _kept_tokens(routing: Routing) -> torch.Tensor:
    """Token index of each kept choice, in (token, choice) order: (N,)."""
    kept = routing.kept_TK
    token_T = torch.arange(kept.shape[0], device=kept.device)
    return token_T.unsqueeze(1).expand_as(kept)[kept]


def shard_experts(moe: MoE, link: dispatch.ExpertLink | Group) -> None:
    """Keep only this rank's experts (contiguous block) and route tokens over the
    link's EP group (a bare group: uncompressed).

    Raises:
        ConfigError: the experts do not divide evenly over the group, or padded
            dispatch has no fixed capacity.
    """
    link = link if isinstance(link, dispatch.ExpertLink) else dispatch.ExpertLink(link)
    ep = link.g
    if moe.num_experts % ep.size:
        raise ConfigError(
            f"model.moe.num_experts={moe.num_experts} must be divisible by parallel.ep={ep.size}"
        )
    if moe.dispatch is Dispatch.PADDED and moe.capacity_tokens is None and ep.size > 1:
        raise ConfigError(
            "capacity-padded expert parallelism needs the same capacity on every rank: "
            "give the MoE layer capacity_tokens"
        )
    local = moe.num_experts // ep.size
    first = ep.rank * local
    for name in ("w1", "w3", "w2"):
        full = getattr(moe.experts, name)
        setattr(moe.experts, name, nn.Parameter(full.detach()[first : first + local].clone()))
    moe.ep, moe.first_expert = link, first
