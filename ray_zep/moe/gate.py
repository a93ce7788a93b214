"""Top-k gating with expert capacity: which expert slot each token choice takes.

Pure computation on one routing group (one rank's tokens of a step), which may
arrive in pieces (the micro-batches of a pipelined block). Slots go in token
order, a token's first choice before its second, so the slot of a choice
depends only on the tokens before it: routing a group piece by piece, with the
counts of the earlier pieces carried over, drops exactly the choices that
routing it whole drops. A choice past its expert's capacity is dropped: its
weight is zero and it occupies no slot.

Legend: T tokens, X experts, K choices per token (top-k), D model dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Balance:
    """Load-balancing statistics of some tokens, additive over pieces and ranks.

    Attributes:
        first_counts_X: tokens whose first choice is each expert.
        prob_sum_X: sum of the gate probabilities of each expert (differentiable).
        tokens: number of tokens.
    """

    first_counts_X: torch.Tensor
    prob_sum_X: torch.Tensor
    tokens: int

    def __add__(self, other: Balance) -> Balance:
        return Balance(
            self.first_counts_X + other.first_counts_X,
            self.prob_sum_X + other.prob_sum_X,
            self.tokens + other.tokens,
        )

    def loss(self, first_counts_X: torch.Tensor | None = None, tokens: int | None = None):
        """GShard balance loss X · Σ_e f_e · P_e (1.0 when perfectly balanced).

        f_e and the normaliser of P_e come from `first_counts_X` / `tokens` when
        given (the whole job's, after an all-reduce) and from these tokens
        otherwise. With the job's figures, the sum over ranks of every rank's
        value is the loss of the whole batch, gradients included.
        """
        counts = self.first_counts_X if first_counts_X is None else first_counts_X
        total = max(self.tokens if tokens is None else tokens, 1)
        experts = counts.numel()
        return experts * (counts.float() / total * self.prob_sum_X / total).sum()


@dataclass(frozen=True)
class RoutingGroups:
    """How the tokens of one MoE call split into routing groups (capacity is per group).

    A distributed run routes each rank's tokens as one group; the one-process
    reference routes the whole batch in the groups the run it mirrors forms
    (`parallel.reference_layout`), so both drop exactly the same choices.

    Attributes:
        order: token indices in group order (within a group, the order that run
            routes them in).
        sizes: tokens of each group.
    """

    order: np.ndarray
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Routing:
    """Where every (token, choice) goes.

    Attributes:
        expert_TK: expert of each choice.
        weight_TK: gate weight of each choice (float32; 0 where dropped).
        slot_TK: position in its expert's batch, -1 where dropped.
        kept_TK: whether the choice fits its expert's capacity.
        counts_X: choices kept per expert.
        claimed_X: choices made per expert, kept or not, including those of the
            earlier pieces of the group (pass it to the next piece's `route`).
        balance: load-balancing statistics of these tokens.
    """

    expert_TK: torch.Tensor
    weight_TK: torch.Tensor
    slot_TK: torch.Tensor
    kept_TK: torch.Tensor
    counts_X: torch.Tensor
    claimed_X: torch.Tensor
    balance: Balance

    @property
    def aux_loss(self) -> torch.Tensor:
        """Balance loss of these tokens alone."""
        return self.balance.loss()


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(CF · K · T / X); `tokens` (no drop possible) when CF <= 0."""
    if capacity_factor <= 0:
        return tokens
    return math.ceil(capacity_factor * top_k * tokens / experts)


def route(
    logits_TX: torch.Tensor, top_k: int, capacity: int, claimed_X: torch.Tensor | None = None
) -> Routing:
    """Route each token to its top-k experts, at most `capacity` choices per expert.

    Args:
        logits_TX: gate logits (any float dtype; softmax in float32).
        top_k: 1 (weight = the expert's probability) or 2 (the two
            probabilities renormalised to sum to 1).
        capacity: slots per expert in the whole routing group.
        claimed_X: `Routing.claimed_X` of the group's previous piece; None for
            the first piece.
    """
    tokens, experts = logits_TX.shape
    probs_TX = torch.softmax(logits_TX.float(), dim=-1)
    top_p_TK, expert_TK = torch.topk(probs_TX, top_k, dim=-1)
    weight_TK = top_p_TK if top_k == 1 else top_p_TK / top_p_TK.sum(-1, keepdim=True)
    if claimed_X is None:
        claimed_X = torch.zeros(experts, dtype=torch.int64, device=logits_TX.device)
    one_hot = torch.nn.functional.one_hot(expert_TK.reshape(-1), experts)  # (token, choice) order
    claimed_NX = torch.cumsum(one_hot, dim=0) + claimed_X
    slot_TK = (claimed_NX.gather(1, expert_TK.reshape(-1, 1)) - 1).view(tokens, top_k)
    kept_TK = slot_TK < capacity
    balance = Balance(torch.bincount(expert_TK[:, 0], minlength=experts), probs_TX.sum(0), tokens)
    return Routing(
        expert_TK=expert_TK,
        weight_TK=weight_TK * kept_TK,
        slot_TK=torch.where(kept_TK, slot_TK, -1),
        kept_TK=kept_TK,
        counts_X=torch.bincount(expert_TK[kept_TK], minlength=experts),
        claimed_X=claimed_NX[-1] if tokens else claimed_X,
        balance=balance,
    )
