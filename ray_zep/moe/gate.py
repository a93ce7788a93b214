"""Top-k gating with expert capacity: which expert slot each token choice takes.

Pure computation on one routing group (one rank's tokens of a step). Choices
claim slots in priority order: every token's first choice, in token order,
then every token's second choice (GShard), so a token's best expert is the
last to drop it. A choice past its expert's capacity is dropped: its weight
is zero and it occupies no slot.

Legend: T tokens, X experts, K choices per token (top-k), D model dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Routing:
    """Where every (token, choice) goes.

    Attributes:
        expert_TK: expert of each choice.
        weight_TK: gate weight of each choice (float32; 0 where dropped).
        slot_TK: position in its expert's batch, -1 where dropped.
        kept_TK: whether the choice fits its expert's capacity.
        counts_X: choices kept per expert.
        aux_loss: GShard load-balancing loss of the group, X · Σ_e f_e · P_e
            (f_e: share of tokens whose first choice is e; P_e: mean gate
            probability of e); 1.0 when perfectly balanced.
    """

    expert_TK: torch.Tensor
    weight_TK: torch.Tensor
    slot_TK: torch.Tensor
    kept_TK: torch.Tensor
    counts_X: torch.Tensor
    aux_loss: torch.Tensor


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(CF · K · T / X); `tokens` (no drop possible) when CF <= 0."""
    if capacity_factor <= 0:
        return tokens
    return math.ceil(capacity_factor * top_k * tokens / experts)


def route(logits_TX: torch.Tensor, top_k: int, capacity: int) -> Routing:
    """Route each token to its top-k experts, at most `capacity` choices per expert.

    Args:
        logits_TX: gate logits (any float dtype; softmax in float32).
        top_k: 1 (weight = the expert's probability) or 2 (the two
            probabilities renormalised to sum to 1).
        capacity: slots per expert.
    """
    tokens, experts = logits_TX.shape
    probs_TX = torch.softmax(logits_TX.float(), dim=-1)
    top_p_TK, expert_TK = torch.topk(probs_TX, top_k, dim=-1)
    weight_TK = top_p_TK if top_k == 1 else top_p_TK / top_p_TK.sum(-1, keepdim=True)
    order_KT = expert_TK.t()  # priority: all first choices, then all second choices
    one_hot = torch.nn.functional.one_hot(order_KT.reshape(-1), experts)
    slot = (torch.cumsum(one_hot, dim=0) - 1).gather(1, order_KT.reshape(-1, 1)).view(top_k, tokens)
    slot_TK = slot.t()
    kept_TK = slot_TK < capacity
    first_share_X = torch.bincount(expert_TK[:, 0], minlength=experts).float() / max(tokens, 1)
    aux = experts * (first_share_X * probs_TX.mean(0)).sum() if tokens else probs_TX.sum()
    return Routing(
        expert_TK=expert_TK,
        weight_TK=weight_TK * kept_TK,
        slot_TK=torch.where(kept_TK, slot_TK, -1),
        kept_TK=kept_TK,
        counts_X=torch.bincount(expert_TK[kept_TK], minlength=experts),
        aux_loss=aux,
    )
