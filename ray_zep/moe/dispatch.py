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
from dataclasses import dataclass

import torch

from ray_zep.collectives import in_flight
from ray_zep.collectives.adaptive import AdaptiveCollectives
from ray_zep.collectives.ops import (
    PlainAllToAll,
    ZippedAllToAll,
    all_gather_ints,
    post_plain_all_to_all,
)
from ray_zep.distributed.group import Group
from ray_zep.options import CompressionStream

ExpertFn = Callable[[torch.Tensor, list[int]], torch.Tensor]
"""(rows sorted by local expert, rows of each local expert) -> the experts' outputs, in
the same order (one call for all local experts: `ray_zep.moe.layer.Experts`)."""


@dataclass(frozen=True)
class ExpertLink:
    """How an MoE block's tokens reach the ranks holding its experts.

    Attributes:
        g: the EP group.
        switch: the group's compression switch (`comm.compression` on): the
            dispatch and combine travel as the `expert_all_to_all` stream, plain
            or zipped (a move, so the same bits), in the design it models faster.
    """

    g: Group
    switch: AdaptiveCollectives | None = None

    @property
    def size(self) -> int:
        return self.g.size

    def post(
        self, x_ND: torch.Tensor, send_rows, recv_rows, what: str, total_rows: int
    ) -> PlainAllToAll | ZippedAllToAll:
        """Start moving rows; `.wait()` on the result gives the received rows (and
        fills its `out`). `total_rows`: rows of the whole exchange, all ranks."""
        if self.switch is None:
            return post_plain_all_to_all(x_ND, send_rows, recv_rows, self.g, what)
        agreed = total_rows * x_ND[0].numel() * x_ND.element_size() // self.g.size
        stream = CompressionStream.EXPERT_ALL_TO_ALL.value
        return self.switch.post_all_to_all_rows(
            x_ND.contiguous(), list(send_rows), list(recv_rows), stream, what, agreed
        )


class _AllToAll(torch.autograd.Function):
    """All-to-all of rows whose gradient is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x_ND, in_rows, out_rows, link: ExpertLink, what: str, total: int):
        ctx.rows, ctx.link, ctx.what, ctx.total = (in_rows, out_rows), link, what, total
        return link.post(x_ND, in_rows, out_rows, what, total).wait()

    @staticmethod
    def backward(ctx, grad_ND):
        in_rows, out_rows = ctx.rows
        back = ctx.link.post(grad_ND, out_rows, in_rows, ctx.what + " (backward)", ctx.total)
        return back.wait(), None, None, None, None, None


def all_to_all_rows(
    x_ND: torch.Tensor,
    in_rows: Sequence[int],
    out_rows: Sequence[int],
    link: ExpertLink,
    what: str,
    total_rows: int,
) -> torch.Tensor:
    """Differentiable all-to-all of rows: in_rows[r] rows to rank r, out_rows[r] from r
    (`total_rows`: rows of the whole exchange, the same on every rank)."""
    return _AllToAll.apply(x_ND, list(in_rows), list(out_rows), link, what, total_rows)


@dataclass
class Ticket(in_flight.Ticket):
    """One all-to-all of rows in flight: its sizes (`ray_zep.collectives.in_flight`)."""

    send_rows: list[int]
    recv_rows: list[int]
    link: ExpertLink
    what: str
    total_rows: int

    def move(self, x_ND: torch.Tensor, backward: bool):
        if backward:
            what = self.what + " (backward)"
            return self.link.post(x_ND, self.recv_rows, self.send_rows, what, self.total_rows)
        return self.link.post(x_ND, self.send_rows, self.recv_rows, self.what, self.total_rows)


new_order = in_flight.new_order


def post_rows(
    x_ND: torch.Tensor,
    send_rows: Sequence[int],
    recv_rows: Sequence[int],
    link: ExpertLink,
    what: str,
    order: torch.Tensor,
    total_rows: int,
) -> tuple[torch.Tensor, Ticket, torch.Tensor]:
    """Start a differentiable all-to-all of rows; pass the result to `wait_rows`.

    The returned tensor is not filled until `wait_rows`; nothing but `wait_rows`
    may read it. In backward the reverse transfer runs between the two as well.
    `order` (from `new_order`, then from the previous post or wait) chains the
    transfers, so that backward runs them in exactly the reverse of the forward
    order on every rank (`ray_zep.collectives.in_flight`).

    Returns:
        The receive buffer, the transfer's ticket, and the next `order`.
    """
    ticket = Ticket(list(send_rows), list(recv_rows), link, what, total_rows)
    out, order = in_flight.post(x_ND, ticket, order)
    return out, ticket, order


def wait_rows(
    buffer_ND: torch.Tensor, ticket: Ticket, order: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows `post_rows` started to move, once they have arrived, and the next `order`."""
    return in_flight.wait(buffer_ND, ticket, order)


def padded_experts(buf_XCD: torch.Tensor, experts: ExpertFn, link: ExpertLink) -> torch.Tensor:
    """Outputs of every expert on its `capacity` slots, experts spread over the link's group."""
    total, capacity, dim = buf_XCD.shape
    size = link.size
    local = total // size
    rows = [local * capacity] * size
    flat = buf_XCD.reshape(total * capacity, dim)
    every = total * capacity * size
    got = all_to_all_rows(flat, rows, rows, link, "MoE dispatch", every)
    by_expert = got.view(size, local, capacity, dim).transpose(0, 1).reshape(-1, dim)
    out = experts(by_expert, [size * capacity] * local)
    back = out.view(local, size, capacity, dim).transpose(0, 1).reshape(-1, dim)
    combined = all_to_all_rows(back, rows, rows, link, "MoE combine", every)
    return combined.view(total, capacity, dim)


@dataclass(frozen=True)
class Splits:
    """Row counts of one variable-split dispatch.

    Attributes:
        send_rows: rows this rank sends to each rank.
        recv: recv[s][j], rows arriving from rank s for local expert j.
    """

    send_rows: list[int]
    recv: list[list[int]]
    total_rows: int
    """Rows every rank sends, summed (the same on every rank)."""

    @classmethod
    def exchange(cls, counts_X: torch.Tensor, g: Group) -> Splits:
        """Split sizes for rows sorted by expert, counts_X rows each (collective: an
        all-gather of every rank's counts, so every rank also knows the total)."""
        size = g.size
        local = counts_X.numel() // size
        send_rows = counts_X.view(size, local).sum(1).tolist()
        every = all_gather_ints(counts_X.tolist(), g, "MoE expert counts")  # [source][expert]
        mine = slice(g.rank * local, (g.rank + 1) * local)
        total = sum(sum(row) for row in every)
        return cls(send_rows, [every[s][mine] for s in range(size)], total)

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
    rows_ND: torch.Tensor, counts_X: torch.Tensor, experts: ExpertFn, link: ExpertLink
) -> torch.Tensor:
    """Outputs for rows sorted by expert (counts_X rows each), experts spread over the link."""
    splits = Splits.exchange(counts_X, link.g)
    send, recv, total = splits.send_rows, splits.recv_rows, splits.total_rows
    got = all_to_all_rows(rows_ND, send, recv, link, "MoE dispatch", total)
    back = run_local_experts(got, splits, experts)
    return all_to_all_rows(back, recv, send, link, "MoE combine", total)
