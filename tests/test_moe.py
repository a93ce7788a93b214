"""MoE layer: gating and capacity rules, and expert parallelism equal to one process.

Tolerance: fp32 on CPU; EP computes each expert on the same rows as one
process but sums gate gradients across ranks in a different order, so values
agree to rounding (relative 1e-5, the project's bound).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ray_zep.distributed.group import Group
from ray_zep.errors import PlacementError
from ray_zep.moe.gate import expert_capacity, route
from ray_zep.moe.layer import Dispatch, MoE, shard_experts
from tests.helpers.procs import run_ranks

DIM, HIDDEN, EXPERTS = 16, 24, 8
CAPACITY_T = 32
"""Tokens of the capacity formula, the same on every rank (their token counts differ)."""
REL = 1e-5


def build(top_k: int, capacity_factor: float, dispatch: Dispatch) -> MoE:
    moe = MoE(DIM, HIDDEN, EXPERTS, top_k, capacity_factor, dispatch, capacity_tokens=CAPACITY_T)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return moe


def tokens_of(rank: int) -> torch.Tensor:
    """Each rank's routing group; sizes differ by rank (at most CAPACITY_T)."""
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(11 + 7 * rank, DIM, generator=gen)


def objective(y_TD: torch.Tensor, moe: MoE) -> torch.Tensor:
    weights = torch.linspace(-1, 1, y_TD.numel()).view_as(y_TD)
    return (y_TD * weights).sum() + 0.1 * moe.aux_loss


@pytest.mark.unit
def test_slots_go_in_token_order_first_choice_first():
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 0.0, 4.0], [0.0, 5.0, 4.0]])
    routing = route(logits, top_k=2, capacity=1)
    # t0 takes experts 0 and 1; t1's first choice (0) drops, its second takes 2;
    # t2 finds both 1 and 2 taken.
    assert routing.kept_TK.tolist() == [[True, True], [False, True], [False, False]]
    assert routing.counts_X.tolist() == [1, 1, 1]
    assert routing.weight_TK[1, 0].item() == 0.0 and routing.weight_TK[1, 1].item() > 0
    p0, p1 = torch.softmax(logits[0], 0)[:2]
    assert routing.weight_TK[0, 0].item() == pytest.approx((p0 / (p0 + p1)).item())


@pytest.mark.unit
@pytest.mark.parametrize("top_k", [1, 2])
def test_routing_in_pieces_drops_what_routing_whole_drops(top_k):
    logits = torch.randn(40, 4, generator=torch.Generator().manual_seed(3)) * 3
    whole = route(logits, top_k, capacity=6)
    claimed, kept, slots, balance = None, [], [], None
    for piece in logits.split([7, 0, 13, 20]):
        part = route(piece, top_k, capacity=6, claimed_X=claimed)
        claimed = part.claimed_X
        kept.append(part.kept_TK)
        slots.append(part.slot_TK)
        balance = part.balance if balance is None else balance + part.balance
    assert torch.equal(torch.cat(kept), whole.kept_TK)
    assert torch.equal(torch.cat(slots), whole.slot_TK)
    assert balance.loss().item() == pytest.approx(whole.aux_loss.item(), rel=1e-6)


@pytest.mark.unit
def test_capacity_and_balance_loss():
    assert expert_capacity(100, 8, 2, 1.25) == 32
    assert expert_capacity(100, 8, 1, 0) == 100
    balanced = route(torch.eye(4).repeat(5, 1) * 10, top_k=1, capacity=5)
    assert balanced.aux_loss.item() == pytest.approx(1.0, abs=1e-3)
    skewed = route(torch.tensor([[10.0, 0, 0, 0]]).repeat(20, 1), top_k=1, capacity=20)
    assert skewed.aux_loss.item() == pytest.approx(4.0, rel=1e-3)


@pytest.mark.unit
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 0.0])
def test_padded_and_varlen_dispatch_agree(top_k, capacity_factor):
    a, b = (
        build(top_k, capacity_factor, Dispatch.PADDED),
        build(top_k, capacity_factor, Dispatch.VARLEN),
    )
    x = tokens_of(3).requires_grad_()
    ya, yb = a(x), b(x)
    torch.testing.assert_close(ya, yb, rtol=REL, atol=1e-6)
    ga = torch.autograd.grad(objective(ya, a), [x, *a.parameters()])
    gb = torch.autograd.grad(objective(yb, b), [x, *b.parameters()])
    for u, v in zip(ga, gb, strict=True):
        torch.testing.assert_close(u, v, rtol=REL, atol=1e-5)


def ep_rank(rank: int, world: int, top_k: int, capacity_factor: float, dispatch: str) -> dict:
    mode = Dispatch(dispatch)
    reference = build(top_k, capacity_factor, mode)
    ref_out = reference(tokens_of(rank))
    loss = sum(objective(reference(tokens_of(r)), reference) for r in range(world))
    ref_grads = _named_grads(reference, loss)
    moe = build(top_k, capacity_factor, mode)
    shard_experts(moe, Group(dist.group.WORLD, 60.0))
    x = tokens_of(rank)
    out = moe(x)
    grads = _named_grads(moe, objective(out, moe))
    dist.all_reduce(grads["gate.weight"])
    local = slice(moe.first_expert, moe.first_expert + EXPERTS // world)
    errors = {"output": _rel(out, ref_out.detach())}
    for name, grad in grads.items():
        ref = ref_grads[name] if name == "gate.weight" else ref_grads[name][local]
        errors[name] = _rel(grad, ref)
    dropped = int((ref_out.abs().sum(1) == 0).sum())
    return {"errors": errors, "dropped": dropped}


def _named_grads(moe: MoE, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    names, params = zip(*moe.named_parameters(), strict=True)
    return dict(zip(names, torch.autograd.grad(loss, list(params)), strict=True))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.unit
def test_dropless_padded_dispatch_refuses_more_tokens_than_it_was_sized_for():
    moe = build(1, 0.0, Dispatch.PADDED)
    with pytest.raises(PlacementError, match="capacity_tokens"):
        moe(torch.randn(CAPACITY_T + 1, DIM))
    assert (moe(torch.randn(CAPACITY_T, DIM)).abs().sum(1) > 0).all(), "dropless drops nothing"


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dispatch", ["padded", "varlen"])
@pytest.mark.parametrize("top_k, capacity_factor", [(1, 1.0), (2, 0.75), (2, 0.0)])
def test_expert_parallel_equals_one_process(world, dispatch, top_k, capacity_factor):
    results = run_ranks(ep_rank, world, top_k, capacity_factor, dispatch)
    for rank, result in enumerate(results):
        for name, err in result["errors"].items():
            assert err <= REL, f"rank {rank} {name}: max rel. error {err:.2e}"
    if capacity_factor and top_k == 1:
        assert sum(r["dropped"] for r in results) > 0, "the case should drop tokens"
