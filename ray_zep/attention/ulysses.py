"""Ulysses: the members of a ring position swap token rows for head slices.

Before the ring each member sends every member the Q, K and V of its rows for that
member's heads (a member gets the K/V heads its query heads use, `Heads`); after it
the outputs go back to the rows' owners, and in backward the output gradients go out
the same way and dQ/dK/dV come back (`ulysses_gradient_dtype`). The engine runs these
exchanges whole (`ray_zep.attention.engine`); `ray_zep.attention.ulysses_chunks` runs
them in pieces beside the projections.

Shapes: T rows of this rank, H query heads, K key/value heads, E head dim; P rows of
a position layout, H' and K' heads held after the exchange.
"""

from __future__ import annotations

import torch

from ray_zep.attention.kv_exchange import exchange
from ray_zep.attention.schedule import ItemSchedule
from ray_zep.options import CompressionStream


class Heads:
    """Head slices a Ulysses member owns: its query heads and the K/V heads they use."""

    def __init__(self, heads: int, kv_heads: int, members: int) -> None:
        self.q_per = heads // members
        self.shared_kv = members > kv_heads
        """Members share K/V heads (each holds one), and an owner sums their dK/dV."""
        if not self.shared_kv:
            per = kv_heads // members
            self.kv = [list(range(m * per, (m + 1) * per)) for m in range(members)]
        else:
            self.kv = [[m * kv_heads // members] for m in range(members)]

    def q(self, m: int) -> slice:
        return slice(m * self.q_per, (m + 1) * self.q_per)


def scatter_heads(q, k, v, item, heads: Heads, schedule, links):
    """Ulysses forward exchange: rows of all members, heads of this member."""
    me, dim = item.part, q.shape[2]
    kv = torch.stack((k, v), dim=1)
    payload = [
        torch.cat((q[:, heads.q(m)].reshape(-1), kv[:, :, heads.kv[m]].reshape(-1)))
        for m in range(item.item.ulysses)
    ]
    kv_per = len(heads.kv[me])
    width = (heads.q_per + 2 * kv_per) * dim
    received = _swap(payload, item.member_tokens, width, item, schedule, links, "Q/K/V")
    q_parts, kv_parts = [], []
    for m, flat in enumerate(received):
        rows = item.member_tokens[m]
        q_len = rows * heads.q_per * dim
        q_parts.append(flat[:q_len].view(rows, heads.q_per, dim))
        kv_parts.append(flat[q_len:].view(rows, 2, kv_per, dim))
    return _to_position(torch.cat(q_parts), item), _to_position(torch.cat(kv_parts), item)


def scatter_q(x_THE, item, heads: Heads, schedule, links):
    """Backward twin of the Q part of `scatter_heads` (for output gradients)."""
    dim = x_THE.shape[2]
    payload = [x_THE[:, heads.q(m)].reshape(-1) for m in range(item.item.ulysses)]
    received = _swap(
        payload, item.member_tokens, heads.q_per * dim, item, schedule, links, "output gradient"
    )
    parts = [flat.view(-1, heads.q_per, dim) for flat in received]
    return _to_position(torch.cat(parts), item)


def gather_out(out_PHE, item, heads: Heads, schedule, links):
    """Ulysses return exchange: this member's rows, all heads."""
    rows = out_PHE[item.gather_order].split(list(item.member_tokens))
    payload = [r.reshape(-1) for r in rows]
    mine = item.member_tokens[item.part]
    dim = out_PHE.shape[2]
    received = _swap(
        payload, [mine] * len(payload), heads.q_per * dim, item, schedule, links, "attention output"
    )
    out = out_PHE.new_empty((mine, heads.q_per * len(payload), dim))
    for m, flat in enumerate(received):
        out[:, heads.q(m)] = flat.view(mine, heads.q_per, dim)
    return out


def ulysses_gradient_dtype(heads: Heads, compute: torch.dtype) -> torch.dtype:
    """The dtype dQ/dK/dV travel in back to their token owners: the compute dtype where
    every K/V head has one member (each owner receives each value once and keeps it in
    that dtype: the same gradients as float32 on the wire, for half the bytes in bf16
    runs, as DeepSpeed-Ulysses' all-to-all sends them); float32 where members share K/V
    heads (more members than K/V heads), whose dK/dV the owner sums."""
    return torch.float32 if heads.shared_kv else compute


def return_grads(dq_PHE, dkv_P2KE, item, heads: Heads, kv_heads: int, dtype, schedule, links):
    """Ulysses backward return: dQ, dK, dV of this member's rows, all heads, in
    `ulysses_gradient_dtype` of the compute `dtype` (float32 once received)."""
    kv_per, dim = dkv_P2KE.shape[2], dq_PHE.shape[2]
    order = item.gather_order
    sizes = list(item.member_tokens)
    wire = ulysses_gradient_dtype(heads, dtype)
    payload = [
        torch.cat((dq.reshape(-1), dkv.reshape(-1))).to(wire)
        for dq, dkv in zip(dq_PHE[order].split(sizes), dkv_P2KE[order].split(sizes), strict=True)
    ]
    mine = item.member_tokens[item.part]
    width = (heads.q_per + 2 * kv_per) * dim
    received = _swap(payload, [mine] * len(payload), width, item, schedule, links, "Q/K/V gradient")
    members = len(payload)
    dq = dq_PHE.new_zeros((mine, heads.q_per * members, dim))
    dkv = dq_PHE.new_zeros((mine, 2, kv_heads, dim))
    for m, flat in enumerate(received):
        q_len = mine * heads.q_per * dim
        dq[:, heads.q(m)] = flat[:q_len].view(mine, heads.q_per, dim)
        dkv[:, :, heads.kv[m]] += flat[q_len:].view(mine, 2, kv_per, dim)
    return dq, dkv[:, 0], dkv[:, 1]


def _to_position(rows_by_member: torch.Tensor, item: ItemSchedule) -> torch.Tensor:
    out = torch.empty_like(rows_by_member)
    out[item.gather_order] = rows_by_member
    return out


def _swap(payload, recv_rows, row_numel, item, schedule, links, what):
    """Send payload[m] to member m; receive recv_rows[m] rows of row_numel elements from m."""
    me, peers = item.part, item.ulysses_peers
    received = [
        payload[me] if m == me else payload[me].new_empty(recv_rows[m] * row_numel)
        for m in range(len(payload))
    ]
    others = [m for m in range(len(payload)) if m != me]
    exchange(
        [(payload[m], peers[m]) for m in others],
        [(received[m], peers[m]) for m in others],
        links,
        schedule.ops,
        f"Ulysses {what} exchange",
        zip_stream=CompressionStream.ULYSSES_ALL_TO_ALL.value,
    ).wait()
    return received
