"""Transfers left in flight between two autograd nodes, forward and backward.

`post` starts a transfer and returns its receive buffer; `wait` completes it. Between
the two a caller computes, and in backward the reverse transfer runs between them as
well (`wait`'s backward posts it, `post`'s backward waits for it), so computation
overlaps communication both ways. What moves, and how, is the ticket's `move`: the
MoE dispatch and combine (`ray_zep.moe.dispatch`) and the Ulysses head exchange in
chunks (`ray_zep.attention.ulysses_chunks`) are two kinds of ticket.

An `order` tensor (from `new_order`, then from the previous `post` or `wait`) chains
the transfers: every rank must post and wait for them in the same order, and autograd,
left alone, may reach the backward of independent branches in a different order on
different ranks. Threaded through every call and added (it is zero) to the results'
graph, it makes backward run the transfers in exactly the reverse of the forward order.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Transfer(Protocol):
    """A posted transfer: `out` is its receive buffer, filled once `wait` returns."""

    out: torch.Tensor

    def wait(self) -> object: ...


class Ticket:
    """One transfer in flight and, in backward, its reverse. Subclasses say what moves
    (`move`); the two transfers are held here between the autograd nodes."""

    transfer: Transfer | None = None
    backward_transfer: Transfer | None = None

    def move(self, x: torch.Tensor, backward: bool) -> Transfer:
        """Post the transfer of `x` (backward: the reverse one, of its gradient)."""
        raise NotImplementedError


class _Post(torch.autograd.Function):
    """Posts the transfer; its backward waits for the reverse transfer `_Wait` posted."""

    @staticmethod
    def forward(ctx, x, order, ticket: Ticket):
        ticket.transfer = ticket.move(x, backward=False)
        ctx.ticket = ticket
        return ticket.transfer.out, order.clone()

    @staticmethod
    def backward(ctx, grad, grad_order):
        ticket = ctx.ticket
        transfer, ticket.backward_transfer = ticket.backward_transfer, None
        transfer.wait()
        return transfer.out, grad_order, None


class _Wait(torch.autograd.Function):
    """Waits for the transfer; its backward posts the reverse transfer."""

    @staticmethod
    def forward(ctx, buffer, order, ticket: Ticket):
        ticket.transfer.wait()  # fills buffer (the transfer's `out`)
        # The transfer holds `out`, whose grad_fn (`_Post`'s node) holds the ticket: kept,
        # that loop runs through autograd's C++ nodes, which Python's garbage collector
        # does not see, and every step's buffers, graph and work handles would stay alive.
        ticket.transfer = None
        ctx.ticket = ticket
        return buffer, order.clone()

    @staticmethod
    def backward(ctx, grad, grad_order):
        ticket = ctx.ticket
        ticket.backward_transfer = ticket.move(grad.contiguous(), backward=True)
        # _Post's backward returns what this transfer delivers and ignores what flows
        # along the graph here.
        return grad, grad_order, None


def new_order(like: torch.Tensor) -> torch.Tensor:
    """Start of an order chain for `post` / `wait` (a zero that needs a gradient)."""
    return torch.zeros((), dtype=like.dtype, device=like.device, requires_grad=True)


def post(x: torch.Tensor, ticket: Ticket, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Start `ticket`'s transfer of `x`: (its receive buffer, the next `order`). Nothing
    but `wait` may read the buffer."""
    return _Post.apply(x, order, ticket)


def wait(
    buffer: torch.Tensor, ticket: Ticket, order: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `post` started to move, once it has arrived, and the next `order`."""
    return _Wait.apply(buffer, order, ticket)
