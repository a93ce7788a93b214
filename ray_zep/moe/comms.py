"""Expert parallelism: differentiable all-to-all dispatch and combine.

Experts are split evenly and contiguously over the EP group: rank r holds
experts [r·X_l, (r+1)·X_l). Two ways to move tokens:

- capacity-padded: every rank sends every expert exactly `capacity` slots
  (empty ones zero), so sizes are fixed and nothing waits on the host;
- variable-split: only kept choices travel; the per-expert counts are
  exchanged first (one small all-to-all, read on the host).

Both return exactly what running all experts locally on the same slots
returns. Legend: X experts, X_l local experts, C capacity, N rows, D model dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ray_zep.collectives.comms import Group, all_to_all_v, exchange_rows

ExpertFn = Callable[[torch.Tensor, int], torch.Tensor]
"""(rows of one local expert, local expert index) -> that expert's outputs."""


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose gradient is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x_ND, in_rows, out_rows, g: Group, what: str):
        ctx.rows, ctx.g, ctx.what = (in_rows, out_rows), g, what
        return all_to_all_v(x_ND, in_rows, out_rows, g, what)

    @staticmethod
    def backward(ctx, grad_ND):
        in_rows, out_rows = ctx.rows
        grad = all_to_all_v(grad_ND, out_rows, in_rows, ctx.g, ctx.what + " (backward)")
        return grad, None, None, None, None


def all_to_all_rows(
    x_ND: torch.Tensor, in_rows: Sequence[int], out_rows: Sequence[int], g: Group, what: str
) -> torch.Tensor:
    """Differentiable all-to-all of rows: in_rows[r] rows to rank r, out_rows[r] from r."""
    return _AllToAll.apply(x_ND, list(in_rows), list(out_rows), g, what)


def padded_experts(buf_XCD: torch.Tensor, experts: ExpertFn, g: Group) -> torch.Tensor:
    """Outputs of every expert on its `capacity` slots, experts spread over `g`."""
    total, capacity, dim = buf_XCD.shape
    local = total // g.size
    rows = [local * capacity] * g.size
    flat = buf_XCD.reshape(total * capacity, dim)
    got = all_to_all_rows(flat, rows, rows, g, "MoE dispatch").view(g.size, local, capacity, dim)
    by_expert = got.transpose(0, 1).reshape(local, g.size * capacity, dim)
    out = torch.stack([experts(by_expert[j], j) for j in range(local)])
    back = out.view(local, g.size, capacity, dim).transpose(0, 1).reshape(-1, dim)
    return all_to_all_rows(back, rows, rows, g, "MoE combine").view(total, capacity, dim)


def varlen_experts(
    rows_ND: torch.Tensor, counts_X: torch.Tensor, experts: ExpertFn, g: Group
) -> torch.Tensor:
    """Outputs for rows sorted by expert (counts_X rows each), experts spread over `g`."""
    total = counts_X.numel()
    local = total // g.size
    send_rows = counts_X.view(g.size, local).sum(1).tolist()
    received = exchange_rows(counts_X.tolist(), g)  # [source s, local expert j] flattened
    recv = [received[s * local : (s + 1) * local] for s in range(g.size)]
    got = all_to_all_rows(rows_ND, send_rows, [sum(r) for r in recv], g, "MoE dispatch")
    pieces = list(got.split([n for source in recv for n in source]))
    outputs = [None] * len(pieces)
    for j in range(local):
        index = [s * local + j for s in range(g.size)]
        sizes = [pieces[i].shape[0] for i in index]
        out = experts(torch.cat([pieces[i] for i in index]), j)
        for i, part in zip(index, out.split(sizes), strict=True):
            outputs[i] = part
    back = torch.cat(outputs) if outputs else got
    return all_to_all_rows(back, [sum(r) for r in recv], send_rows, g, "MoE combine")
