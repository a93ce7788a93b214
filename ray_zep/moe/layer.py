"""Mixture-of-Experts feed-forward layer: top-k gate, capacity, SwiGLU experts.

Plain PyTorch; runs in one process with all experts. `shard_experts` turns it
into one rank's part under expert parallelism: the rank keeps its experts'
weights and moves tokens with `moe.comms`. The result per token is the same
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

from ray_zep.collectives.comms import Group
from ray_zep.config import MoEDispatch as Dispatch
from ray_zep.errors import ConfigError, PlacementError
from ray_zep.moe import comms
from ray_zep.moe.gate import Balance, Routing, expert_capacity, route


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
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        if dispatch is Dispatch.AUTO:
            dispatch = Dispatch.PADDED if capacity_factor > 0 else Dispatch.VARLEN
        self.dispatch, self.capacity_tokens = dispatch, capacity_tokens
        self.gate = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.ep: Group | None = None
        self.first_expert = 0
        self.balance: Balance | None = None
        """Load-balancing statistics of the last forward (its routing group)."""

    @property
    def aux_loss(self) -> torch.Tensor:
        """Balance loss of the last forward's routing group alone."""
        return self.balance.loss() if self.balance is not None else torch.zeros(())

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
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
            return expert_capacity(tokens, self.experts, self.top_k, self.capacity_factor)
        if self.capacity_factor <= 0 and tokens > self.capacity_tokens:
            raise PlacementError(
                f"a rank holds {tokens} tokens, more than the {self.capacity_tokens} the "
                "dropless capacity-padded MoE was sized for; raise capacity_tokens"
            )
        return expert_capacity(self.capacity_tokens, self.experts, self.top_k, self.capacity_factor)

    def sharded_parameter_names(self) -> dict[str, str]:
        """Parameters that differ between EP ranks, with a name unique to this shard."""
        if self.ep is None:
            return {}
        last = self.first_expert + self.w1.shape[0] - 1
        return {name: f"{name}.experts_{self.first_expert}_{last}" for name in ("w1", "w3", "w2")}

    def expert(self, x_ND: torch.Tensor, local: int) -> torch.Tensor:
        """SwiGLU of local expert `local` on its rows."""
        w1, w3, w2 = self.w1[local], self.w3[local], self.w2[local]
        return F.linear(F.silu(F.linear(x_ND, w1)) * F.linear(x_ND, w3), w2)

    def _padded(self, x_TD: torch.Tensor, routing: Routing, capacity: int) -> torch.Tensor:
        kept, token_N = routing.kept_TK, _kept_tokens(routing)
        buf_XCD = x_TD.new_zeros((self.experts, capacity, x_TD.shape[1]))
        buf_XCD = buf_XCD.index_put((routing.expert_TK[kept], routing.slot_TK[kept]), x_TD[token_N])
        if self.ep is None:
            out_XCD = torch.stack([self.expert(buf_XCD[e], e) for e in range(self.experts)])
        else:
            out_XCD = comms.padded_experts(buf_XCD, self.expert, self.ep)
        picked_TKD = out_XCD[routing.expert_TK, routing.slot_TK.clamp_min(0)]
        return (picked_TKD * routing.weight_TK.unsqueeze(-1).to(x_TD.dtype)).sum(1)

    def _varlen(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        choices = SortedChoices.of(routing)
        rows_ND = x_TD[choices.token_N]
        if self.ep is None:
            out_ND = self.all_experts(rows_ND, routing.counts_X)
        else:
            out_ND = comms.varlen_experts(rows_ND, routing.counts_X, self.expert, self.ep)
        return choices.combine(out_ND, x_TD)

    def all_experts(self, rows_ND: torch.Tensor, counts_X: torch.Tensor) -> torch.Tensor:
        """Every expert (all held here) on rows sorted by expert, counts_X rows each."""
        parts = rows_ND.split(counts_X.tolist())
        return torch.cat([self.expert(p, e) for e, p in enumerate(parts)])


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


def shard_experts(moe: MoE, ep: Group) -> None:
    """Keep only this rank's experts (contiguous block) and route tokens over `ep`.

    Raises:
        ConfigError: the experts do not divide evenly over the group, or padded
            dispatch has no fixed capacity.
    """
    if moe.experts % ep.size:
        raise ConfigError(
            f"model.moe.num_experts={moe.experts} must be divisible by parallel.ep={ep.size}"
        )
    if moe.dispatch is Dispatch.PADDED and moe.capacity_tokens is None and ep.size > 1:
        raise ConfigError(
            "capacity-padded expert parallelism needs the same capacity on every rank: "
            "give the MoE layer capacity_tokens"
        )
    local = moe.experts // ep.size
    first = ep.rank * local
    for name in ("w1", "w3", "w2"):
        full = getattr(moe, name)
        setattr(moe, name, nn.Parameter(full.detach()[first : first + local].clone()))
    moe.ep, moe.first_expert = ep, first
