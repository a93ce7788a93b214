"""The Ulysses head exchanges of USP items in row chunks, beside the projections.

A Ulysses member swaps its rows' Q/K/V for every member's rows of its own heads before
the ring, and the output back after it (`ray_zep.attention.engine`). Run whole, each
exchange waits between two linear modules. Here a rank's rows of each USP item are
split into `chunks` pieces: the Q/K/V projection of a piece runs while the pieces
before it travel, and the output projection of a piece while the pieces after it
arrive; in backward the output's gradient goes out a piece at a time as the output
projection's backward makes it, and each piece's dQ/dK/dV returns while the
projection's backward of the pieces after it runs (`ray_zep.collectives.in_flight`
keeps each transfer in flight between two autograd nodes and orders them the same on
every rank).

Every member splits its rows the same way (`chunk_sizes`), so each knows what each
piece it receives holds. The gradients travel in the compute dtype (where members
share a K/V head, autograd sums their dK/dV in it too).

Shapes: T rows of this rank, D model dim, H query heads, K key/value heads, E head
dim; P rows of a position, H' and K' heads held after the exchange.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ray_zep.attention.engine import run_attention, run_exchanged_attention
from ray_zep.attention.kv_exchange import exchange
from ray_zep.attention.links import Links
from ray_zep.attention.schedule import ItemSchedule, RankSchedule
from ray_zep.attention.ulysses import Heads
from ray_zep.collectives import in_flight
from ray_zep.options import CompressionStream

Projection = Callable[[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], tuple]
"""(x_TD rows, rope rows) -> (q_THE, k_TKE, v_TKE) of those rows."""


def chunk_sizes(rows: int, chunks: int) -> list[int]:
    """`rows` split into `chunks` pieces, the first ones a row longer where it does not
    divide (pieces may be empty)."""
    base, extra = divmod(rows, chunks)
    return [base + (c < extra) for c in range(chunks)]


class _Swap:
    """One posted piece of a Ulysses exchange: `out` holds every member's message to
    this one, member after member, once `wait` returns."""

    def __init__(self, x_flat, send, recv, item: ItemSchedule, schedule, links, what) -> None:
        me, peers = item.part, item.ulysses_peers
        self.out = x_flat.new_empty(sum(recv))
        sends = x_flat.split(send)
        into = self.out.split(recv)
        into[me].copy_(sends[me])
        others = [m for m in range(len(send)) if m != me]
        self._pending = exchange(
            [(sends[m], peers[m]) for m in others if send[m]],
            [(into[m], peers[m]) for m in others if recv[m]],
            links,
            schedule.ops,
            f"Ulysses {what} exchange",
            zip_stream=CompressionStream.ULYSSES_ALL_TO_ALL.value,
        )

    def wait(self) -> torch.Tensor:
        self._pending.wait()
        return self.out


class _SwapTicket(in_flight.Ticket):
    """A piece's exchange: `send[m]` elements to member m, `recv[m]` from it; its
    backward sends the gradient of what arrived back to where it came from."""

    def __init__(self, send, recv, item, schedule, links, what) -> None:
        self.send, self.recv, self.what = send, recv, what
        self.item, self.schedule, self.links = item, schedule, links

    def move(self, x_flat: torch.Tensor, backward: bool) -> _Swap:
        if backward:
            what = self.what + " gradient"
            return _Swap(x_flat, self.recv, self.send, self.item, self.schedule, self.links, what)
        return _Swap(x_flat, self.send, self.recv, self.item, self.schedule, self.links, self.what)


def overlapped_attention(
    x_TD: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    inputs: Projection,
    output: Callable[[torch.Tensor], torch.Tensor],
    schedule: RankSchedule,
    links: Links,
    kernels,
    chunks: int,
) -> torch.Tensor:
    """The attention block's output rows, `output(attention(inputs(x_TD, rope)))`, with
    each USP item's head exchanges in `chunks` pieces beside the projections."""
    usp = [i for i, item in enumerate(schedule.items) if item.item.ulysses > 1]
    if not usp:
        return output(run_attention(*inputs(x_TD, rope), schedule, links, kernels))
    order = in_flight.new_order(x_TD)
    posted = {}
    for i in usp:
        posted[i], order = _post_inputs(x_TD, rope, inputs, schedule.items[i], schedule, links,
                                        chunks, order)  # fmt: skip
    segments = _segments(schedule, usp, x_TD.shape[0])
    projected = {seg: inputs(x_TD[seg[0] : seg[1]], _rows(rope, *seg)) for seg in segments
                 if seg[2] is None}  # fmt: skip
    exchanged = {}
    for i in usp:
        exchanged[i], order = _wait_inputs(posted.pop(i), schedule.items[i], order)
    like = next(iter(exchanged.values()))[2]
    q_THE, k_TKE, v_TKE = (
        torch.cat([projected[s][n] if s[2] is None else _zeros(like[n], s) for s in segments])
        for n in range(3)
    )
    out_THE, outs = run_exchanged_attention(
        q_THE, k_TKE, v_TKE, schedule, links, kernels, {i: e[:2] for i, e in exchanged.items()}
    )
    returning = {}
    for i, out_pos in zip(usp, outs, strict=True):
        returning[i], order = _post_outputs(out_pos, schedule.items[i], schedule, links,
                                            chunks, order)  # fmt: skip
    parts = {seg: output(out_THE[seg[0] : seg[1]]) for seg in segments if seg[2] is None}
    for i in usp:
        pieces, order = _wait_outputs(returning.pop(i), schedule.items[i], output, order)
        parts[next(seg for seg in segments if seg[2] == i)] = pieces
    y_TD = torch.cat([parts[seg] for seg in segments])
    return y_TD + order  # order is zero: it keeps the chain in the graph


def _segments(schedule: RankSchedule, usp: list[int], rows: int) -> list[tuple]:
    """This rank's rows as (start, stop, USP item index or None) in row order: each USP
    item's rows, and the rows between them (other items, padding) in one piece each."""
    segments, start = [], 0
    for i in usp:
        first, stop = schedule.items[i].rows
        if first > start:
            segments.append((start, first, None))
        segments.append((first, stop, i))
        start = stop
    if rows > start or not segments:
        segments.append((start, rows, None))
    return segments


def _rows(rope, start: int, stop: int, *_):
    return tuple(table[start:stop] for table in rope)


def _zeros(like: torch.Tensor, seg) -> torch.Tensor:
    """Rows of a USP item in the tensors the engine reads for its other items."""
    return like.new_zeros((seg[1] - seg[0], *like.shape[1:]))


def _post_inputs(x_TD, rope, inputs, item: ItemSchedule, schedule, links, chunks, order):
    """Project this member's rows of `item` a piece at a time, posting each piece's
    Q/K/V (member m's head slices to member m, row by row) before projecting the next."""
    me, members = item.part, item.item.ulysses
    sizes = [chunk_sizes(rows, chunks) for rows in item.member_tokens]
    pieces, heads, start = [], None, item.rows[0]
    for c, rows in enumerate(sizes[me]):
        if rows or heads is None:
            q, k, v = inputs(x_TD[start : start + rows], _rows(rope, start, start + rows))
        else:  # an empty piece (fewer rows than pieces): no projection call for it
            q, k, v = q[:0], k[:0], v[:0]
        start += rows
        if heads is None:
            heads = Heads(q.shape[1], k.shape[1], members)
        kv = torch.stack((k, v), dim=1)
        payload = [torch.cat((q[:, heads.q(m)], kv[:, :, heads.kv[m]].flatten(1, 2)), dim=1)
                   for m in range(members)]  # fmt: skip
        width = payload[me].shape[1:].numel()
        recv = [sizes[m][c] * width for m in range(members)]
        ticket = _SwapTicket([p.numel() for p in payload], recv, item, schedule, links, "Q/K/V")
        buffer, order = in_flight.post(torch.cat([p.reshape(-1) for p in payload]), ticket, order)
        pieces.append((buffer, ticket, recv, payload[me].shape[1:]))
    return (pieces, heads, (q, k, v)), order


def _wait_inputs(posted, item: ItemSchedule, order):
    """The position's Q (P, H', E) and K/V (P, 2, K', E) once every piece arrived, and a
    projected piece's (q, k, v) for the shapes of the rows the engine reads."""
    pieces, heads, projected = posted
    rows_by_member = [[] for _ in range(item.item.ulysses)]
    for buffer, ticket, recv, row_shape in pieces:
        got, order = in_flight.wait(buffer, ticket, order)
        for m, flat in enumerate(got.split(recv)):
            rows_by_member[m].append(flat.view(-1, *row_shape))
    rows = torch.cat([piece for member in rows_by_member for piece in member])
    rows = rows.index_select(0, _inverse(item.gather_order))
    q_PHE = rows[:, : heads.q_per].contiguous()
    kv_P2KE = rows[:, heads.q_per :].unflatten(1, (2, -1)).contiguous()
    return (q_PHE, kv_P2KE, projected), order


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """The permutation undoing `order` (position row of each row by member)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def _post_outputs(out_PHE, item: ItemSchedule, schedule, links, chunks, order):
    """Post the output's pieces: piece c of member m's rows, this member's heads, to m."""
    members, me = item.item.ulysses, item.part
    by_member = out_PHE.index_select(0, item.gather_order).split(list(item.member_tokens))
    split = [rows.split(chunk_sizes(rows.shape[0], chunks)) for rows in by_member]
    width = out_PHE.shape[1] * out_PHE.shape[2]
    mine = chunk_sizes(item.member_tokens[me], chunks)
    posted = []
    for c in range(chunks):
        flat = torch.cat([split[m][c].reshape(-1) for m in range(members)])
        send = [split[m][c].shape[0] * width for m in range(members)]
        ticket = _SwapTicket(send, [mine[c] * width] * members, item, schedule, links,
                             "attention output")  # fmt: skip
        buffer, order = in_flight.post(flat, ticket, order)
        posted.append((buffer, ticket, mine[c], out_PHE.shape[1:]))
    return posted, order


def _wait_outputs(posted, item: ItemSchedule, output, order):
    """This member's rows of the item through the output projection, piece by piece as
    each arrives (all heads: member m's slice from member m)."""
    members = item.item.ulysses
    pieces = []
    for buffer, ticket, rows, (heads, dim) in posted:
        got, order = in_flight.wait(buffer, ticket, order)
        by_member = got.view(members, rows, heads, dim).transpose(0, 1)
        out_THE = by_member.reshape(rows, members * heads, dim)
        if rows or not pieces:  # an empty piece adds no rows: no projection call for it
            pieces.append(output(out_THE))
    return torch.cat(pieces), order
