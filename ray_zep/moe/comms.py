"""Expert parallelism: differentiable all-to-all dispatch and combine.

Experts are split evenly and contiguously over the EP group: rank r holds
experts [r·X_l, (r+1)·X_l). Two ways to move tokens:

- capacity-padded: every rank sends every expert exactly `capacity` slots
  (empty ones zero), so sizes are fixed and nothing waits on the host;
- variable-split: only kept choices travel; the per-expert counts are
  exchanged first (one small all-to-all, read on the host).

Both return exactly what running all experts locally on the same slots
returns. The variable-split transfer also comes as a pair of autograd
functions, `post_rows` / `wait_rows`, that leave the transfer in flight
between them, in forward and (in reverse) in backward, so a pipelined block
computes while its tokens travel. Legend: X experts, X_l local experts,
C capacity, N rows, D model dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ray_zep.collectives.comms import all_to_all_v, exchange_rows, post_all_to_all
from ray_zep.dist.group import Group

ExpertFn = Callable[[torch.Tensor, list[int]], torch.Tensor]
"""(rows sorted by local expert, rows of each local expert) -> the experts' outputs, in
the same order (one call for all local experts: `ray_zep.moe.layer.Experts`)."""


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


@dataclass
class Ticket:
    """One all-to-all of rows in flight: its sizes and its work handles."""

    send_rows: list[int]
    recv_rows: list[int]
    g: Group
    what: str
    work: object = None
    backward_work: object = None
    backward_out: torch.Tensor | None = field(default=None, repr=False)


def _post_rows(x_ND: torch.Tensor, send_rows, recv_rows, g: Group):
    row = x_ND.shape[1:].numel()
    sizes = ([r * row for r in send_rows], [r * row for r in recv_rows])
    out, work = post_all_to_all(x_ND.contiguous().view(-1), *sizes, g)
    return out.view(sum(recv_rows), *x_ND.shape[1:]), work


class _Post(torch.autograd.Function):
    """Posts the transfer; its backward waits for the reverse transfer `_Wait` posted."""

    @staticmethod
    def forward(ctx, x_ND, order, ticket: Ticket):
        out, ticket.work = _post_rows(x_ND, ticket.send_rows, ticket.recv_rows, ticket.g)
        ctx.ticket = ticket
        return out, order.clone()

    @staticmethod
    def backward(ctx, grad_ND, grad_order):
        ticket = ctx.ticket
        ticket.g.wait([ticket.backward_work], ticket.what + " (backward)")
        return ticket.backward_out, grad_order, None


class _Wait(torch.autograd.Function):
    """Waits for the transfer; its backward posts the reverse transfer."""

    @staticmethod
    def forward(ctx, buffer_ND, order, ticket: Ticket):
        ticket.g.wait([ticket.work], ticket.what)
        ctx.ticket = ticket
        return buffer_ND, order.clone()

    @staticmethod
    def backward(ctx, grad_ND, grad_order):
        ticket = ctx.ticket
        out, ticket.backward_work = _post_rows(
            grad_ND, ticket.recv_rows, ticket.send_rows, ticket.g
        )
        ticket.backward_out = out
        # _Post's backward returns `backward_out` once the transfer is done and
        # ignores what flows along the graph here.
        return grad_ND, grad_order, None


def new_order(like: torch.Tensor) -> torch.Tensor:
    """Start of an order chain for `post_rows` / `wait_rows` (a zero that needs a gradient)."""
    return torch.zeros((), dtype=like.dtype, device=like.device, requires_grad=True)


def post_rows(
    x_ND: torch.Tensor,
    send_rows: Sequence[int],
    recv_rows: Sequence[int],
    g: Group,
    what: str,
    order: torch.Tensor,
) -> tuple[torch.Tensor, Ticket, torch.Tensor]:
    """Start a differentiable all-to-all of rows; pass the result to `wait_rows`.

    The returned tensor is not filled until `wait_rows`; nothing but `wait_rows`
    may read it. In backward the reverse transfer runs between the two as well.

    `order` (from `new_order`, then from the previous post or wait) chains the
    transfers: every rank must post and wait for them in the same order, and
    autograd, left alone, may reach the backward of independent micro-batches
    in a different order on different ranks. Threaded through every call and
    added (it is zero) to the result, it makes backward run the transfers in
    exactly the reverse of the forward order.

    Returns:
        The receive buffer, the transfer's ticket, and the next `order`.
    """
    ticket = Ticket(list(send_rows), list(recv_rows), g, what)
    out, order = _Post.apply(x_ND, order, ticket)
    return out, ticket, order


def wait_rows(
    buffer_ND: torch.Tensor, ticket: Ticket, order: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows `post_rows` started to move, once they have arrived, and the next `order`."""
    return _Wait.apply(buffer_ND, order, ticket)


def padded_experts(buf_XCD: torch.Tensor, experts: ExpertFn, g: Group) -> torch.Tensor:
    """Outputs of every expert on its `capacity` slots, experts spread over `g`."""
    total, capacity, dim = buf_XCD.shape
    local = total // g.size
    rows = [local * capacity] * g.size
    flat = buf_XCD.reshape(total * capacity, dim)
    got = all_to_all_rows(flat, rows, rows, g, "MoE dispatch").view(g.size, local, capacity, dim)
    by_expert = got.transpose(0, 1).reshape(local * g.size * capacity, dim)
    out = experts(by_expert, [g.size * capacity] * local)
    back = out.view(local, g.size, capacity, dim).transpose(0, 1).reshape(-1, dim)
    return all_to_all_rows(back, rows, rows, g, "MoE combine").view(total, capacity, dim)


@dataclass(frozen=True)
class Splits:
    """Row counts of one variable-split dispatch.

    Attributes:
        send_rows: rows this rank sends to each rank.
        recv: recv[s][j], rows arriving from rank s for local expert j.
    """

    send_rows: list[int]
    recv: list[list[int]]

    @classmethod
    def exchange(cls, counts_X: torch.Tensor, g: Group) -> Splits:
        """Split sizes for rows sorted by expert, counts_X rows each (collective)."""
        local = counts_X.numel() // g.size
        send_rows = counts_X.view(g.size, local).sum(1).tolist()
        received = exchange_rows(counts_X.tolist(), g)  # [source s, local expert j] flattened
        return cls(send_rows, [received[s * local : (s + 1) * local] for s in range(g.size)])

    @property
    def recv_rows(self) -> list[int]:
        return [sum(r) for r in self.recv]


def run_local_experts(got_ND: torch.Tensor, splits: Splits, experts: ExpertFn) -> torch.Tensor:
    """Outputs of the local experts on the rows a dispatch delivered, in the same order."""
    local = len(splits.recv[0]) if splits.recv else 0
    sources = len(splits.recv)
    pieces = list(got_ND.split([n for source in splits.recv for n in source]))
    if not pieces:
        return got_ND
    by_expert = [s * local + j for j in range(local) for s in range(sources)]
    out = experts(
        torch.cat([pieces[i] for i in by_expert]),
        [sum(splits.recv[s][j] for s in range(sources)) for j in range(local)],
    )
    outputs = [None] * len(pieces)
    for i, part in zip(by_expert, out.split([pieces[i].shape[0] for i in by_expert]), strict=True):
        outputs[i] = part
    return torch.cat(outputs)


def varlen_experts(
    rows_ND: torch.Tensor, counts_X: torch.Tensor, experts: ExpertFn, g: Group
) -> torch.Tensor:
    """Outputs for rows sorted by expert (counts_X rows each), experts spread over `g`."""
    splits = Splits.exchange(counts_X, g)
    got = all_to_all_rows(rows_ND, splits.send_rows, splits.recv_rows, g, "MoE dispatch")
    back = run_local_experts(got, splits, experts)
    return all_to_all_rows(back, splits.recv_rows, splits.send_rows, g, "MoE combine")
