"""FoldMoE: the pipelined MoE block computes what the plain block computes.

Every schedule (moe_only, aaam, 1a1m), overlap degree d in {1, 2, 4, 8},
top-1 and top-2, with a capacity that drops choices and dropless, on one rank
and under expert parallelism over 2 and 4 gloo ranks: block outputs, the input
gradient and every parameter gradient agree with the plain block.

Tolerance: fp32 on CPU. Slicing changes the order of attention's sums and
the micro-batches change the order of the expert and gate gradient sums, so
results agree to rounding: relative 1e-5 (the project's bound).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ray_zep.attention.kernels import torch_varlen_attention
from ray_zep.attention.rope import rope_tables
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.config import MoEPipeline
from ray_zep.distributed.group import Group
from ray_zep.model.llama import Block
from ray_zep.model_shapes import ModelShape
from ray_zep.moe.gate import route
from ray_zep.moe.layer import shard_experts
from ray_zep.moe.pipeline import FoldedForward
from tests.helpers.procs import run_ranks

REL = 1e-5
SCHEDULES = [MoEPipeline.MOE_ONLY, MoEPipeline.AAAM, MoEPipeline.ONE_A_ONE_M]
DEGREES = [1, 2, 4, 8]


def _shape(top_k: int, capacity_factor: float) -> ModelShape:
    return ModelShape(
        vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48,
        moe_experts=8, moe_top_k=top_k, moe_capacity_factor=capacity_factor,
        moe_hidden=24, moe_every=1,
    )  # fmt: skip


def _block(shape: ModelShape, world: int) -> Block:
    block = Block(shape, 0)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    block.feed_forward.capacity_tokens = 64
    if world > 1:
        import torch.distributed as dist

        shard_experts(block.feed_forward, Group(dist.group.WORLD, 60.0))
    return block


def _inputs(rank: int, shape: ModelShape):
    lengths = [5 + 3 * rank, 17, 9 + rank]
    seqs = PackedSeqs.from_lengths(lengths)
    positions = torch.from_numpy(seqs.positions())
    rope = rope_tables(positions, shape.head_dim, shape.rope_theta)
    x = torch.randn(sum(lengths), shape.dim, generator=torch.Generator().manual_seed(rank))
    return x, rope, seqs


def _run(block: Block, x: torch.Tensor, rope, seqs):
    x = x.clone().requires_grad_(True)
    y = block(x, rope, seqs, torch_varlen_attention)
    weights = torch.linspace(-1, 1, y.numel()).view_as(y)
    ((y * weights).sum() + 0.1 * block.feed_forward.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    return y.detach(), x.grad.clone(), grads


def _dropped(block: Block, x: torch.Tensor, rope, seqs) -> int:
    """Choices the plain block drops on these tokens."""
    captured = {}
    handle = block.feed_forward.gate.register_forward_hook(
        lambda m, i, o: captured.__setitem__("logits", o)
    )
    with torch.no_grad():
        block(x, rope, seqs, torch_varlen_attention)
    handle.remove()
    moe = block.feed_forward
    routing = route(captured["logits"], moe.top_k, moe.capacity(x.shape[0]))
    return int((~routing.kept_TK).sum())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _compare_all(rank: int, world: int) -> list[str]:
    failures = []
    for top_k, cf in itertools.product([1, 2], [0.5, 0.0]):
        shape = _shape(top_k, cf)
        x, rope, seqs = _inputs(rank, shape)
        plain = _block(shape, world)
        if cf > 0:
            assert _dropped(plain, x, rope, seqs) > 0, "the capacity must drop some choices"
        want = _run(plain, x, rope, seqs)
        for schedule, d, uniform in itertools.product(SCHEDULES, DEGREES, [True, False]):
            if schedule is MoEPipeline.MOE_ONLY and not uniform:
                continue  # moe_only does not slice attention
            block = _block(shape, world)
            block.pipeline = FoldedForward(schedule, d, uniform)
            got = _run(block, x, rope, seqs)
            case = f"rank {rank} top{top_k} cf={cf} {schedule.value} d={d} uniform={uniform}"
            errors = {"output": _rel(got[0], want[0]), "input grad": _rel(got[1], want[1])}
            errors.update({f"grad {n}": _rel(got[2][n], g) for n, g in want[2].items()})
            failures += [f"{case}: {k} rel {v:.2e}" for k, v in errors.items() if v > REL]
    return failures


@pytest.mark.unit
def test_pipelined_block_equals_plain_block_on_one_rank():
    assert _compare_all(0, 1) == []


@pytest.mark.dist
@pytest.mark.parametrize("ep", [2, 4])
def test_pipelined_block_equals_plain_block_under_expert_parallelism(ep: int):
    for failures in run_ranks(_compare_all, ep):
        assert failures == []


def _tickets_left_after_steps(rank: int, world: int) -> int:
    import gc

    from ray_zep.moe.dispatch import Ticket

    shape = _shape(1, 0.0)
    x, rope, seqs = _inputs(rank, shape)
    block = _block(shape, world)
    block.pipeline = FoldedForward(MoEPipeline.ONE_A_ONE_M, 2, True)
    for _ in range(2):
        _run(block, x, rope, seqs)
    del block
    gc.collect()
    return sum(isinstance(o, Ticket) for o in gc.get_objects())


@pytest.mark.dist
def test_pipelined_steps_free_their_transfers():
    """Once a step's outputs are gone, none of its all-to-alls stays alive (their receive
    buffers, graph and work handles): a transfer kept after its wait closes a loop
    through autograd's nodes that the garbage collector cannot free, one per step."""
    assert run_ranks(_tickets_left_after_steps, 2) == [0, 0]
