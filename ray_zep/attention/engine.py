"""The attention engine: runs a rank's queue items for one layer, forward and backward.

One autograd Function covers all items of the layer, so every rank issues its
communication in the same global order in backward too (autograd does not
order independent branches). Items run inter-node -> intra-node -> local; groups
that share no rank run at the same time because each rank only waits on its own
peers. Per item:

1. Ulysses (U > 1): members swap token rows for head slices (Q, and K/V with
   their own head count: a member gets the K/V heads its query heads use;
   `ray_zep.attention.ulysses`), unless the item's heads came in already, in pieces
   beside the projections (`run_exchanged_attention`, `ray_zep.attention.ulysses_chunks`:
   then its output stays on the position, and its gradients come and go there);
2. ring positions exchange K and V as the item's exchange kind plays it
   (`ray_zep.partition.exchange.Play`; `_FORWARD` and `_BACKWARD` hold each
   play's path): rotated step by step with the next step's transfer posted
   before the current step's compute, or all-gathered; outputs and LSEs merge
   in fp32; backward rotates K/V again (or reads the ones a kept ring received in
   the forward, computing its own block last: `ExchangeKind.backward_order`) and
   passes the dK/dV accumulators around the ring back to their owners (under
   `parallel.dkv_wire=owner`, items inside a node and Ulysses groups send each step's
   dK/dV straight to them instead, `_owner_backward`), or reduce-scatters them. Where the
   layout trims its messages (`ray_zep.partition.layout`), a K/V message (and a dK/dV
   one to its owner) carries only the rows its receivers attend to (`Trimmed`); a
   step's dK/dV over those rows is laid out over the whole block for an accumulator;
3. Ulysses: outputs (and in backward the gradients, in the compute dtype where each
   K/V head has one member: `ulysses_gradient_dtype`) go back to the token owners.

A local item (one rank) is a single causal varlen call with no communication.
With `parallel.routing`, a ring transfer between nodes goes through proxy ranks
(`ray_zep.routing`): the main thread posts its hops like a direct exchange, and
this rank's relay thread forwards the pieces it proxies for other ranks during
the call.
Input rows past `schedule.tokens` are padding: their outputs and gradients are zero.

Shapes: T rows of this rank, H query heads, K key/value heads, E head dim;
P rows of a position layout, H' and K' heads held after the Ulysses exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ray_zep.attention import ring
from ray_zep.attention.kernels import AttentionFn, BackwardKernel
from ray_zep.attention.kv_exchange import all_gather_rows, exchange, reduce_scatter_rows
from ray_zep.attention.links import Links
from ray_zep.attention.schedule import ItemSchedule, RankSchedule
from ray_zep.attention.ulysses import Heads, gather_out, return_grads, scatter_heads, scatter_q
from ray_zep.errors import CommError
from ray_zep.options import CompressionStream
from ray_zep.partition.exchange import Play
from ray_zep.routing.relay import Channels, RowFormat, post_recv, post_send
from ray_zep.routing.routes import Payload, Phase


@dataclass
class _Saved:
    q_PHE: torch.Tensor
    kv_P2KE: torch.Tensor
    out_PHE: torch.Tensor
    lse_HP: torch.Tensor
    gathered: torch.Tensor | None
    """K/V the backward reads instead of exchanging them again: `Play.GATHER`'s gathered
    rows, a kept ring's received positions (`_ring_forward`), or None."""
    heads: Heads
    kv_heads: int

    TENSORS = ("q_PHE", "kv_P2KE", "out_PHE", "lse_HP", "gathered")
    """The fields backward needs as tensors, in field order."""

    def tensors(self) -> list[torch.Tensor | None]:
        return [getattr(self, name) for name in self.TENSORS]


class AttentionEngine(torch.autograd.Function):
    """out_THE = attention of this rank's rows under the plan (see the module docstring)."""

    @staticmethod
    def forward(ctx, q_THE, k_TKE, v_TKE, schedule: RankSchedule, links: Links, kernels,
                exchanged: tuple[int, ...], *positions):  # fmt: skip
        """`exchanged`: the USP items whose heads came in already (`positions`: their
        q_PHE and kv_P2KE, item after item); their outputs stay on the position."""
        relay = _start_relay(schedule, links, Phase.FORWARD, k_TKE)
        out = torch.zeros_like(q_THE)
        given = dict(zip(exchanged, zip(positions[::2], positions[1::2], strict=True), strict=True))
        saved, outs = [], []
        for index, item in enumerate(schedule.items):
            start, stop = item.rows
            item_out, state = _item_forward(
                q_THE[start:stop],
                k_TKE[start:stop],
                v_TKE[start:stop],
                item,
                schedule,
                links,
                kernels[0],
                given.get(index),
            )
            if index in given:
                outs.append(item_out)
            else:
                out[start:stop] = item_out
            saved.append(state)
        if relay is not None:
            relay.finish_relay()
        ctx.schedule, ctx.links, ctx.kernels = schedule, links, kernels
        ctx.shapes = (q_THE.shape, k_TKE.shape, q_THE.dtype)
        ctx.exchanged = exchanged
        # through save_for_backward, so activation checkpointing can drop and recompute them
        ctx.save_for_backward(*(t for state in saved for t in state.tensors()))
        ctx.meta = [(state.heads, state.kv_heads) for state in saved]
        return (out, *outs)

    @staticmethod
    def backward(ctx, dout_THE, *dout_positions):
        q_shape, k_shape, dtype = ctx.shapes
        dq = torch.zeros(q_shape, dtype=dtype, device=dout_THE.device)
        dk = torch.zeros(k_shape, dtype=dtype, device=dout_THE.device)
        dv = torch.zeros(k_shape, dtype=dtype, device=dout_THE.device)
        relay = _start_relay(ctx.schedule, ctx.links, Phase.BACKWARD, dk)
        tensors = ctx.saved_tensors
        width = len(_Saved.TENSORS)
        saved = [
            _Saved(*tensors[i * width : (i + 1) * width], *meta) for i, meta in enumerate(ctx.meta)
        ]
        given = dict(zip(ctx.exchanged, dout_positions, strict=True))
        dpositions = []
        for index, (item, state) in enumerate(zip(ctx.schedule.items, saved, strict=True)):
            start, stop = item.rows
            if index in given:
                dq_pos, dkv_pos = _item_backward(
                    given[index], item, state, ctx.schedule, ctx.links, ctx.kernels[1], True
                )
                dpositions += [dq_pos.to(dtype), dkv_pos.to(dtype)]
                continue
            grads = _item_backward(
                dout_THE[start:stop], item, state, ctx.schedule, ctx.links, ctx.kernels[1]
            )
            dq[start:stop], dk[start:stop], dv[start:stop] = grads
        if relay is not None:
            relay.finish_relay()
        return dq, dk, dv, None, None, None, None, *dpositions


def run_attention(
    q_THE: torch.Tensor,
    k_TKE: torch.Tensor,
    v_TKE: torch.Tensor,
    schedule: RankSchedule,
    links: Links,
    kernels: tuple[AttentionFn, BackwardKernel],
) -> torch.Tensor:
    """Differentiable attention of a rank's rows; `kernels` = (forward, backward)."""
    return AttentionEngine.apply(q_THE, k_TKE, v_TKE, schedule, links, kernels, ())[0]


def run_exchanged_attention(q_THE, k_TKE, v_TKE, schedule, links, kernels, exchanged: dict):
    """`run_attention` where the USP items of `exchanged` (item index -> (q_PHE,
    kv_P2KE)) had their heads exchanged already (`ray_zep.attention.ulysses_chunks`):
    (out_THE, rows of those items left zero; each of their out_PHE, in index order)."""
    indices = tuple(sorted(exchanged))
    positions = [t for i in indices for t in exchanged[i]]
    out, *outs = AttentionEngine.apply(q_THE, k_TKE, v_TKE, schedule, links, kernels, indices,
                                       *positions)  # fmt: skip
    return out, outs


def _start_relay(schedule: RankSchedule, links: Links, phase: Phase, k_TKE) -> Channels | None:
    """Start this rank's relay on the pieces it forwards in this call (None: nothing to do)."""
    if schedule.routing is None or links.routing is None:
        return None
    rows = RowFormat(k_TKE.shape[1], k_TKE.shape[2], k_TKE.dtype, k_TKE.device,
                     links.dkv_dtype(k_TKE.dtype))  # fmt: skip
    links.routing.start_relay(schedule.relayed[phase], rows)
    return links.routing


def _ring_exchange(send, recv, item: ItemSchedule, step: int, payload, schedule, links, what):
    """Send `send` to the next ring position and receive into `recv` from the previous one,
    directly or through the routing layer when the plan routes that transfer."""
    key = (item.item.ranks, item.item.ulysses)
    out_route = schedule.routes.get((key, step, payload, schedule.rank))
    in_route = schedule.routes.get((key, step, payload, item.ring_prev))
    direct = exchange(
        [] if out_route else [(send, item.ring_next)],
        [] if in_route else [(recv, item.ring_prev)],
        links,
        schedule.ops,
        what,
        zip_stream=CompressionStream.KV.value,
    )
    if out_route is None and in_route is None:
        return direct
    if links.routing is None:
        raise CommError("the plan routes transfers, but parallel.routing is off on this rank")
    works = post_send(send, out_route, links.routing, schedule.ops) if out_route else []
    works += post_recv(recv, in_route, links.routing, schedule.ops) if in_route else []
    return direct.extend(works)


def _item_forward(q, k, v, item: ItemSchedule, schedule: RankSchedule, links: Links, kernel,
                  given=None):  # fmt: skip
    """(this rank's rows of the output, what backward keeps); `given`: the position's
    (q_PHE, kv_P2KE), heads exchanged already, whose output stays on the position."""
    u_size = item.item.ulysses
    if given is not None:
        heads = Heads(given[0].shape[1] * u_size, k.shape[1], u_size)
        q_pos, kv_pos = given
    elif u_size > 1:
        heads = Heads(q.shape[1], k.shape[1], u_size)
        q_pos, kv_pos = scatter_heads(q, k, v, item, heads, schedule, links)
    else:
        heads = Heads(q.shape[1], k.shape[1], u_size)
        q_pos, kv_pos = q, torch.stack((k, v), dim=1)
    out_pos = torch.zeros(q_pos.shape, dtype=torch.float32, device=q.device)
    lse_pos = torch.full(
        (q_pos.shape[1], q_pos.shape[0]), float("-inf"), dtype=torch.float32, device=q.device
    )
    play = _FORWARD[item.play]
    gathered = play(q_pos, kv_pos, item, schedule, links, out_pos, lse_pos, kernel)
    # kept in the compute dtype: what the backward kernels take, cast once, not per step
    out_pos = out_pos.to(q.dtype)
    state = _Saved(q_pos, kv_pos, out_pos, lse_pos, gathered, heads, k.shape[1])
    if u_size > 1 and given is None:
        return gather_out(out_pos, item, heads, schedule, links), state
    return out_pos, state


def _rotate(current, item: ItemSchedule, step: int, schedule, links, what: str, into=None):
    """Post the send of `current` to the next position and the receive of the K/V that
    step `step + 1` uses (into `into`, or a new buffer); (None, None) after the last step."""
    if step + 1 >= len(item.steps):
        return None, None
    rows = item.held_rows(step + 1)
    buf = into if into is not None else current.new_empty((rows, *current.shape[1:]))
    chosen = item.trimmed.send[step] if item.trimmed is not None else None
    sent = current if chosen is None else current.index_select(0, chosen)
    pending = _ring_exchange(sent, buf, item, step, Payload.KV, schedule, links, what)
    return buf, pending.hold(sent)


def _kept_rows(item: ItemSchedule) -> list[int]:
    """Rows of the K/V received for each ring step after the first, in step order (each
    message's, `ItemSchedule.held_rows`)."""
    return [item.held_rows(s) for s in range(1, len(item.steps))]


def _expanded(dkv: torch.Tensor, item: ItemSchedule, step: int) -> torch.Tensor:
    """A step's dK/dV over the rows of the block it held (`Trimmed.held`) laid out over
    the source's whole position layout, for an accumulator of the whole block."""
    rows = item.trimmed.expand[step] if item.trimmed is not None else None
    if rows is None:
        return dkv
    source = item.steps[step].source
    full = dkv.new_zeros((item.position_tokens[source], *dkv.shape[1:]))
    return full.index_copy_(0, rows, dkv)


def _ring_forward(q_pos, kv_pos, item, schedule, links, out_pos, lse_pos, kernel):
    """`Play.ROTATE` forward. Where the item keeps K/V (`ItemSchedule.keeps_kv`), each
    step's K/V is received into one buffer of them all, which it returns for the
    backward; else None."""
    kept = None
    if item.keeps_kv:
        rows = _kept_rows(item)
        kept = kv_pos.new_empty((sum(rows), *kv_pos.shape[1:]))
        into = kept.split(rows)
    current = kv_pos
    for s, step in enumerate(item.steps):
        target = into[s] if kept is not None and s < len(into) else None
        buf, pending = _rotate(current, item, s, schedule, links, "ring K/V exchange", target)
        ring.step_forward(q_pos, current, step, out_pos, lse_pos, kernel)
        if pending is not None:
            pending.wait()
            current = buf
    return kept


def _gathered_forward(q_pos, kv_pos, item, schedule, links, out_pos, lse_pos, kernel):
    """`Play.GATHER` forward; returns every position's K/V (rows of the largest), by rank."""
    gathered = all_gather_rows(kv_pos, max(item.position_tokens), links, schedule.ops)
    for step in item.steps:
        source = gathered[item.item.ranks[step.source * item.item.ulysses + item.part]]
        ring.step_forward(q_pos, source, step, out_pos, lse_pos, kernel)
    return gathered


def _item_backward(dout, item: ItemSchedule, state: _Saved, schedule, links, backward,
                   exchanged=False):  # fmt: skip
    """dQ, dK, dV of this rank's rows; `exchanged`: `dout` is the position's and so are
    the (float32 dQ, dK/dV) returned, which the caller sends home."""
    u_size = item.item.ulysses
    if u_size > 1 and not exchanged:
        dout_pos = scatter_q(dout, item, state.heads, schedule, links)
    else:
        dout_pos = dout
    dq_pos = torch.zeros(state.q_PHE.shape, dtype=torch.float32, device=dout.device)
    play = _BACKWARD[item.play]
    dkv_pos = play(dout_pos, state, item, schedule, links, dq_pos, backward)
    if exchanged:
        return dq_pos, dkv_pos
    if u_size > 1:
        return return_grads(
            dq_pos, dkv_pos, item, state.heads, state.kv_heads, state.q_PHE.dtype, schedule, links
        )
    return dq_pos, dkv_pos[:, 0], dkv_pos[:, 1]


def _ring_backward(dout_pos, state, item, schedule, links, dq_pos, backward):
    """`Play.ROTATE` backward: this position's dK/dV."""

    def contribute(kv_P2KE, step):
        dkv = torch.zeros(kv_P2KE.shape, dtype=torch.float32, device=kv_P2KE.device)
        ring.step_backward(
            dout_pos,
            state.q_PHE,
            kv_P2KE,
            state.out_PHE,
            state.lse_HP,
            step,
            dq_pos,
            dkv,
            backward,
        )
        return dkv

    if len(item.steps) == 1:  # a local item: nothing travels
        return contribute(state.kv_P2KE, item.steps[0])
    if links.dkv_to_owner and item.item.owner_dkv:
        return _owner_backward(state, item, schedule, links, contribute)
    if item.keeps_kv:
        return _kept_ring_backward(state, item, schedule, links, contribute)
    current = state.kv_P2KE
    wire = links.dkv_dtype(current.dtype)  # accumulators sum in float32, travel in `wire`
    incoming = None  # dK/dV accumulator of this step's source, from the previous rank
    dkv_pending = None
    sends_alive = []  # keep sent accumulators alive until their transfers complete
    for s, step in enumerate(item.steps):
        kv_buf, kv_pending = _backward_kv(current, item, s, schedule, links)
        dkv = _expanded(contribute(current, step), item, s)
        if dkv_pending is not None:
            dkv_pending.wait()
            dkv += incoming
        # After the last step the accumulator goes home, and ours arrives.
        last = s + 1 == len(item.steps)
        size = item.position_tokens[item.position if last else item.steps[s + 1].source]
        incoming = dkv.new_empty((size, *dkv.shape[1:]), dtype=wire)
        sent = dkv.to(wire)
        dkv_pending = _ring_exchange(
            sent, incoming, item, s, Payload.DKV, schedule, links, "ring dK/dV exchange"
        )
        sends_alive.append(sent)
        if kv_pending is not None:
            kv_pending.wait()
        if kv_buf is not None:
            current = kv_buf
    dkv_pending.wait()
    return incoming.float()


def _kept_ring_backward(state, item: ItemSchedule, schedule, links, contribute):
    """`Play.ROTATE` backward, dK/dV accumulated around the ring, where the ring kept the
    forward's K/V: steps in `ExchangeKind.backward_order`, this position's own block
    last. At step s >= 1 it adds its block of position p - s's K/V to the accumulator
    position p - 1 sent (none at step 1: that accumulator starts here) and sends it on to
    p + 1; the one sent after step R - 1 reaches its owner, p + 1, while this position
    computes its own block and receives its own from p - 1. `contribute(kv, step)`: one
    step's float32 dK/dV."""
    kept = state.gathered.split(_kept_rows(item))
    wire = links.dkv_dtype(state.kv_P2KE.dtype)  # accumulators sum in float32
    incoming = pending = None  # the accumulator this step adds to, and its receive
    alive = []  # sent accumulators, kept until their transfers complete
    ring = len(item.steps)
    for s in item.item.exchange_kind.backward_order(ring):
        dkv = _expanded(contribute(kept[s - 1] if s else state.kv_P2KE, item.steps[s]), item, s)
        if pending is not None:
            pending.wait()
            dkv += incoming
        if s == 0:
            return dkv
        following = item.steps[s + 1].source if s + 1 < ring else item.position
        incoming = dkv.new_empty((item.position_tokens[following], *dkv.shape[1:]), dtype=wire)
        alive.append(dkv.to(wire))
        pending = _ring_exchange(alive[-1], incoming, item, s, Payload.DKV, schedule, links,
                                 "ring dK/dV exchange")  # fmt: skip
    raise AssertionError("a kept ring's backward ends on its own block")


def _backward_kv(current, item: ItemSchedule, step: int, schedule, links):
    """(the K/V step `step + 1` uses, the pending receive of them or None), rotated anew
    (a ring that kept the forward's reads them instead: `_kept_rows`)."""
    return _rotate(current, item, step, schedule, links, "ring K/V exchange (backward)")


def _owner_backward(state, item, schedule, links, contribute):
    """`Play.ROTATE` backward under `parallel.dkv_wire=owner` (`QueueItem.owner_dkv`):
    K/V rotate as in `_ring_backward`, and each step's dK/dV goes straight to the position
    it belongs to (member u of position p sends step s's to member u of p - s) in the K/V
    dtype, which holds the kernel's output exactly; this position sums what it gets back
    in float32. `contribute(kv, step)`: one step's float32 dK/dV.

    Steps run in `ExchangeKind.backward_order`: where the ring kept the forward's
    K/V (`ItemSchedule.keeps_kv`) the position's own block (step 0) last, so that the last
    dK/dV sent to an owner is in flight during that step's compute, not after the ring's;
    a ring rotating its K/V again holds its own block first, and computes it first."""
    ring, u_size, ranks = item.item.ring_size, item.item.ulysses, item.item.ranks
    assert item.steps[0].source == item.position, "step 0 must be the position's own block"
    current = state.kv_P2KE
    kept = state.gathered.split(_kept_rows(item)) if item.keeps_kv else None
    total = None  # float32 sum of this position's dK/dV: its own step's and those received
    waiting = None  # the previous step's dK/dV to this position, and its buffer
    alive = []  # sent dK/dV, kept until their transfers complete
    for s in item.item.exchange_kind.backward_order(len(item.steps)):
        step = item.steps[s]
        if kept is not None:
            kv, kv_buf, kv_pending = (kept[s - 1] if s else current), None, None
        else:
            kv = current
            kv_buf, kv_pending = _backward_kv(current, item, s, schedule, links)
        dkv = contribute(kv, step)
        if s == 0:
            total = dkv if total is None else total.add_(dkv)
        else:
            owner = ranks[((item.position - s) % ring) * u_size + item.part]
            sender = ranks[((item.position + s) % ring) * u_size + item.part]
            sent = dkv.to(current.dtype)  # the rows of the block it held (`Trimmed`)
            returned = item.trimmed.returned[s] if item.trimmed is not None else None
            rows = item.position_tokens[item.position] if returned is None else len(returned)
            into = sent.new_empty((rows, *sent.shape[1:]))
            stream = CompressionStream.KV.value
            posted = exchange([(sent, owner)], [(into, sender)], links, schedule.ops,
                              "ring dK/dV to owner", zip_stream=stream)  # fmt: skip
            alive.append(sent)
            if waiting is not None:
                total = _received(total, waiting, state.kv_P2KE)
            waiting = (posted, into, returned)
        if kv_pending is not None:
            kv_pending.wait()
        if kv_buf is not None:
            current = kv_buf
    return _received(total, waiting, state.kv_P2KE)


def _received(total, waiting, own):
    """`total` (None: nothing yet) plus the dK/dV of `waiting` (posted, buffer, the rows
    of this position's block they are, None: all) once arrived, in float32; `own`: this
    position's K/V (the shape of its dK/dV)."""
    posted, buffer, rows = waiting
    posted.wait()
    arrived = buffer.float()
    if rows is None:
        return arrived if total is None else total.add_(arrived)
    if total is None:
        total = torch.zeros(own.shape, dtype=torch.float32, device=own.device)
    return total.index_add_(0, rows, arrived)


def _gathered_backward(dout_pos, state, item, schedule, links, dq_pos, backward):
    """`Play.GATHER` backward: this position's dK/dV."""
    gathered = state.gathered
    u_size = item.item.ulysses
    dkv_all = torch.zeros(gathered.shape, dtype=torch.float32, device=gathered.device)
    for step in item.steps:
        owner = item.item.ranks[step.source * u_size + item.part]
        ring.step_backward(
            dout_pos,
            state.q_PHE,
            gathered[owner],
            state.out_PHE,
            state.lse_HP,
            step,
            dq_pos,
            dkv_all[owner],
            backward,
        )
    mine = reduce_scatter_rows(dkv_all, links, schedule.ops)
    return mine[: state.kv_P2KE.shape[0]]


_FORWARD = {Play.ROTATE: _ring_forward, Play.GATHER: _gathered_forward}
"""Each play's forward: (q_pos, kv_pos, item, schedule, links, out_pos, lse_pos, kernel)
-> what backward needs kept (the gathered or kept K/V, or None)."""
_BACKWARD = {Play.ROTATE: _ring_backward, Play.GATHER: _gathered_backward}
"""Each play's backward: (dout_pos, state, item, schedule, links, dq_pos, backward kernel)
-> dK/dV of this position, float32."""
