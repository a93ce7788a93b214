"""USP head exchanges in pieces beside the projections (`ray_zep.attention.ulysses_chunks`):
the attention block's output and every gradient equal one device's, the pieces really
travel apart, and training with them is in `tests/test_strategies.py`'s matrix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_zep.attention.kernels import torch_varlen_attention
from ray_zep.attention.links import Links
from ray_zep.attention.rope import apply_rope, rope_tables
from ray_zep.attention.schedule import RankSchedule
from ray_zep.attention.ulysses_chunks import chunk_sizes, overlapped_attention
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.config import load_config
from ray_zep.distributed import Comm
from ray_zep.parallel.axes import Placement
from ray_zep.partition.plan import AttentionPlan, SeqPlacement, bounds_for_counts, local_placement
from ray_zep.topology import build_topology
from tests.helpers.attention import KERNELS
from tests.helpers.procs import run_ranks

LENGTHS = [61, 5, 3, 9]
DIM, HEAD_DIM = 16, 4


@pytest.mark.unit
def test_chunk_sizes_cover_the_rows_longest_first() -> None:
    assert chunk_sizes(10, 4) == [3, 3, 2, 2]
    assert chunk_sizes(2, 4) == [1, 1, 0, 0]
    assert chunk_sizes(0, 3) == [0, 0, 0]


def _weights(heads: int, kv_heads: int):
    g = torch.Generator().manual_seed(1)
    shapes = [(DIM, heads * HEAD_DIM), (DIM, kv_heads * HEAD_DIM), (DIM, kv_heads * HEAD_DIM),
              (heads * HEAD_DIM, DIM)]  # fmt: skip
    return [torch.randn(shape, generator=g) / 4 for shape in shapes]


def _block(weights, heads: int, kv_heads: int):
    """(inputs, output) of an attention block with these projection weights."""
    wq, wk, wv, wo = weights

    def inputs(x_TD, rope):
        rows = x_TD.shape[0]
        q = apply_rope((x_TD @ wq).view(rows, heads, HEAD_DIM), *rope)
        k = apply_rope((x_TD @ wk).view(rows, kv_heads, HEAD_DIM), *rope)
        return q, k, (x_TD @ wv).view(rows, kv_heads, HEAD_DIM)

    def output(out_THE):
        return out_THE.reshape(out_THE.shape[0], heads * HEAD_DIM) @ wo

    return inputs, output


def _data(heads: int, kv_heads: int):
    g = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    x = torch.randn(total, DIM, generator=g)
    upstream = torch.randn(total, DIM, generator=g)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    return x, upstream, rope_tables(positions, HEAD_DIM, 10000.0), _weights(heads, kv_heads)


def _reference(heads: int, kv_heads: int):
    """One device: the block's output and the gradients of x and of every weight."""
    x, upstream, rope, weights = _data(heads, kv_heads)
    x.requires_grad_(True)
    for w in weights:
        w.requires_grad_(True)
    inputs, output = _block(weights, heads, kv_heads)
    out, _ = torch_varlen_attention(*inputs(x, rope), PackedSeqs.from_lengths(LENGTHS), causal=True)
    y = output(out)
    (y * upstream).sum().backward()
    return y.detach(), x.grad, [w.grad for w in weights]


def _plan(topology) -> AttentionPlan:
    """The long sequence on 3 positions of 2 GPUs starting mid-node (2 x 4), the rest
    whole; or on 2 positions of 2 GPUs (2 x 2)."""
    if topology.gpus_per_node == 4:
        group = SeqPlacement(0, 61, tuple(range(2, 8)), bounds_for_counts([20, 21, 20]), 2)
        rest = [local_placement(1, 5, 0), local_placement(2, 3, 1), local_placement(3, 9, 0)]
    else:
        group = SeqPlacement(0, 61, (0, 1, 2, 3), bounds_for_counts([30, 31]), 2)
        rest = [local_placement(1, 5, 0), local_placement(2, 3, 1), local_placement(3, 9, 2)]
    plan = AttentionPlan(Placement.ZEPPELIN, topology, 64, (group, *rest))
    plan.validate()
    return plan


def _rank(rank: int, world: int, case: dict) -> dict:
    heads, kv_heads = case["heads"], case["kv_heads"]
    config = load_config(None, [f"topology.nodes={case['nodes']}",
                                f"topology.gpus_per_node={case['gpus']}"])  # fmt: skip
    topology = build_topology(config.topology)
    plan = _plan(topology)
    starts = np.concatenate([[0], np.cumsum(LENGTHS)])
    rows = np.concatenate(
        [np.arange(f.start, f.end) + starts[f.seq] for f in plan.layout(rank)] or [[]]
    ).astype(np.int64)
    index = torch.as_tensor(rows)
    x, upstream, rope, weights = _data(heads, kv_heads)
    x = x[index].requires_grad_(True)
    for w in weights:
        w.requires_grad_(True)
    schedule = RankSchedule.build(plan, rank)
    links = Links(Comm.create(topology, topology.world_size, 60.0))
    inputs, output = _block(weights, heads, kv_heads)
    rope = tuple(t[index] for t in rope)
    y = overlapped_attention(x, rope, inputs, output, schedule, links, KERNELS, case["chunks"])
    (y * upstream[index]).sum().backward()
    usp = any(item.item.ulysses > 1 for item in schedule.items)
    return {"rows": rows, "y": y.detach(), "dx": x.grad, "dw": [w.grad for w in weights],
            "p2p": schedule.ops["p2p"], "usp": usp}  # fmt: skip


def _assert_close(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    """fp32: relative error (norm of the difference over the norm) at most 1e-5."""
    if want.numel():
        err = float((got - want).norm() / want.norm().clamp_min(1e-30))
        assert err <= 1e-5, f"{where}: relative error {err:.2e}"


def _all(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [_rank(rank, world, case) for case in cases]


@pytest.mark.dist
@pytest.mark.parametrize("nodes,gpus", [(2, 2), (2, 4)], ids=["2x2", "2x4"])
def test_pieces_beside_the_projections_match_one_device(nodes: int, gpus: int) -> None:
    """Multi-head and grouped-query (K/V heads shared by members), 1, 3 and 16 pieces
    (more pieces than a member has rows: empty ones): every rank's rows of the output
    equal one device's, and the weights' gradients summed over ranks; a rank of the USP
    group posts more messages with more pieces."""
    cases = [dict(nodes=nodes, gpus=gpus, heads=8, kv_heads=kv, chunks=c)
             for kv in (8, 1) for c in (1, 3, 16)]  # fmt: skip
    results = run_ranks(_all, nodes * gpus, cases)
    for index, case in enumerate(cases):
        y, dx, dw = _reference(case["heads"], case["kv_heads"])
        got = [r[index] for r in results]
        for rank, r in enumerate(got):
            rows = torch.as_tensor(r["rows"])
            _assert_close(r["y"], y[rows], f"{case} rank {rank} output")
            _assert_close(r["dx"], dx[rows], f"{case} rank {rank} dx")
        for n, want in enumerate(dw):
            _assert_close(sum(r["dw"][n] for r in got), want, f"{case} weight {n}")
    for first in (0, 3):  # the cases of one K/V head count: 1, 3, 16 pieces
        member = next(r for r in results if r[first]["usp"])
        counts = [member[first + n]["p2p"] for n in range(3)]
        assert counts[0] < counts[1] <= counts[2], counts
