"""Ring bytes over the links, counted without listing transfers: one layer's K/V and
dK/dV over intra-node links and leaving each NIC, hop by hop over all ring steps at
once (`ring_link_bytes`), as `RoutingPlan.link_bytes` counts the listed ones."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ray_zep.partition.carried import Carried
from ray_zep.partition.plan import AttentionPlan, QueueItem, Zone
from ray_zep.routing.routes import Payload, Route, crossing_hops, itemhop_routes, proxy_count
from ray_zep.topology import Topology


def ring_link_bytes(
    plan: AttentionPlan, routed: bool, row_bytes: Callable[[Payload, int], int]
) -> tuple[int, np.ndarray]:
    """`RoutingPlan.build(plan, routed, all_hops=True).link_bytes(...)` without listing
    the transfers: one layer's forward + backward ring bytes over intra-node links and
    leaving each NIC (nodes x NICs), worked out hop by hop over all ring steps at once.

    Args:
        plan: the placement.
        routed: inter-node hops go through proxies (else direct).
        row_bytes: bytes of one row of `payload` for an item of U Ulysses members.
    """
    by_payload = ring_link_bytes_by_payload(plan, routed, row_bytes)
    intra = sum(i for i, _ in by_payload.values())
    return intra, sum(n for _, n in by_payload.values())


def ring_link_bytes_by_payload(
    plan: AttentionPlan,
    routed: bool,
    row_bytes: Callable[[Payload, int], int],
    dkv_owner: bool = False,
) -> dict[Payload, tuple[int, np.ndarray]]:
    """`ring_link_bytes` of each payload (K/V, dK/dV) apart, in one pass over the items:
    a direct hop's bytes over all its steps in closed form, a routed hop's step by step.
    With `dkv_owner` (`parallel.dkv_wire=owner`), an item that sends each step's dK/dV
    to their owners (`QueueItem.owner_dkv`) does so in the K/V dtype: those bytes are
    counted with K/V's, at K/V's row size, each message on its own sender's links."""
    topo = plan.topology
    gpus = topo.gpus_per_node
    nic_of_gpu = np.asarray(topo.gpu_to_nic, dtype=np.int64)
    nic = {p: np.zeros((topo.nodes, topo.nics_per_node), dtype=np.int64) for p in Payload}
    intra = dict.fromkeys(Payload, 0)
    for item in plan.items():
        ring, u_size = item.ring_size, item.ulysses
        if ring < 2 or not item.exchange_kind.routable:
            continue
        if item.zone is Zone.INTRA_NODE:  # most rings: their bytes in closed form
            _add_intra_node_item(plan, item, row_bytes, dkv_owner, intra)
            continue
        held = np.asarray(plan.position_tokens(item), dtype=np.int64)
        hops = np.asarray(item.hops(), dtype=np.int64)  # (position, source, destination)
        position, src, dst = hops[:, 0], hops[:, 1], hops[:, 2]
        # a hop from position p carries position (p - s)'s rows at step s: every position
        # once for dK/dV (all but p itself where the forward's K/V were kept: its own
        # block comes last, `ExchangeKind.backward_order`), all but position p + 1 for
        # K/V (not sent on at the last step); K/V goes round twice (forward, backward)
        # unless the forward's are kept
        # (K/V messages carry the rows their layout keeps on: `AttentionPlan.carried`)
        total = int(held.sum())
        kept = item.exchange_kind.keeps_kv
        trimmed = plan.carried(item)
        carried = {Payload.KV: trimmed.sent()[position]}
        if dkv_owner and item.owner_dkv:  # the dK/dV leave the ring for their owners
            size = row_bytes(Payload.KV, u_size)
            _owner_dkv_bytes(item, trimmed, size, topo, nic_of_gpu, intra, nic)
        else:
            carried[Payload.DKV] = total - held[position] if kept else np.full(len(hops), total)
        rounds = 1 if kept else 2
        sizes = {p: row_bytes(p, u_size) * (rounds if p is Payload.KV else 1) for p in Payload}
        same = src // gpus == dst // gpus
        crossing = crossing_hops(item, topo) if routed and not same.all() else {}
        direct_out = ~same & (not routed or _direct_hops(topo, src, dst, crossing))
        out_nic = (src // gpus, nic_of_gpu[src % gpus])
        for payload, rows in carried.items():
            if (size := sizes[payload]) == 0:
                continue
            intra[payload] += int(rows[same].sum()) * size
            np.add.at(nic[payload], (out_nic[0][direct_out], out_nic[1][direct_out]),
                      rows[direct_out] * size)  # fmt: skip
        if not routed or same.all():
            continue
        routes = {(r.src, r.dst): r for _, r in itemhop_routes(topo, item, routed)}
        for i in np.flatnonzero(~same & ~direct_out).tolist():
            a = int(src[i])
            route = routes[a, int(dst[i])]
            owners = (position[i] - np.arange(ring)) % ring
            steps = held[owners]
            dkv_steps = steps[1:] if kept else steps  # a kept ring sends none at step 0
            kv_steps = trimmed.rows(np.full(ring - 1, (position[i] + 1) % ring), owners[:-1])
            for payload, rows in ((Payload.KV, kv_steps), (Payload.DKV, dkv_steps)):
                if payload not in carried or (size := sizes[payload]) == 0:
                    continue
                if route.direct:
                    nic[payload][a // gpus, nic_of_gpu[a % gpus]] += int(rows.sum()) * size
                else:
                    intra[payload] += routed_hop_bytes(route, rows, size, nic[payload], topo)
    return {p: (intra[p], nic[p]) for p in Payload}


def _add_intra_node_item(
    plan: AttentionPlan,
    item: QueueItem,
    row_bytes: Callable[[Payload, int], int],
    dkv_owner: bool,
    intra: dict[Payload, int],
) -> None:
    """A ring inside one node: all of its bytes are intra-node. Over its R x U hops, the
    K/V rows sent sum to U (R - 1) x its tokens (a hop carries all but the next
    position's), and the dK/dV rows to U R x its tokens (every position's; U (R - 1) x
    where the forward's K/V were kept: no accumulator leaves its own block), or, sent
    to their owners, U (R - 1) x its tokens at K/V's row size."""
    ring, u_size = item.ring_size, item.ulysses
    total = sum(plan.placement(seq).length for seq in item.seqs)
    rounds = 1 if item.exchange_kind.keeps_kv else 2
    kv = row_bytes(Payload.KV, u_size)
    sent = int(plan.carried(item).sent().sum())  # the K/V messages' trimmed rows
    intra[Payload.KV] += u_size * sent * kv * rounds
    if dkv_owner and item.owner_dkv:  # the same (holder, owner) pairs, the same rows
        intra[Payload.KV] += u_size * sent * kv
    else:
        sends = ring - 1 if item.exchange_kind.keeps_kv else ring
        intra[Payload.DKV] += u_size * sends * total * row_bytes(Payload.DKV, u_size)


def _owner_dkv_bytes(item: QueueItem, carried: Carried, size: int, topo: Topology,
                     nic_of_gpu: np.ndarray, intra: dict, nic: dict) -> None:  # fmt: skip
    """Adds to K/V's `intra` and `nic` bytes the dK/dV an owner item sends: member u of
    position p sends the rows it held of position (p - s)'s block (`carried`) to member u
    of that position at every step s >= 1, `size` bytes a row, over its intra-node port
    or its own NIC (`nic_of_gpu`: each GPU of a node's NIC)."""
    ring, u_size, gpus = item.ring_size, item.ulysses, topo.gpus_per_node
    ranks = np.asarray(item.ranks, dtype=np.int64)
    member = np.arange(ranks.size)
    owner_position = (member[:, None] // u_size - np.arange(1, ring)[None, :]) % ring
    src = np.broadcast_to(ranks[:, None], owner_position.shape)
    dst = ranks[owner_position * u_size + (member % u_size)[:, None]]
    rows = carried.rows((member // u_size)[:, None], owner_position)
    same = src // gpus == dst // gpus
    intra[Payload.KV] += int(rows[same].sum()) * size
    leaving = src[~same]
    np.add.at(nic[Payload.KV], (leaving // gpus, nic_of_gpu[leaving % gpus]), rows[~same] * size)


def _direct_hops(topo: Topology, src: np.ndarray, dst: np.ndarray, crossing) -> np.ndarray:
    """Which hops `plan_route` sends direct (one proxy each side: as many of the ring's
    hops cross between their two nodes as the nodes have GPUs, a USP group's)."""
    direct = {
        pair
        for pair, (senders, receivers) in crossing.items()
        if proxy_count(topo, senders[0], receivers[0], senders, receivers) == 1
    }
    gpus = topo.gpus_per_node
    return np.asarray(
        [(a // gpus, b // gpus) in direct for a, b in zip(src.tolist(), dst.tolist(), strict=True)],
        dtype=bool,
    )


def routed_hop_bytes(route: Route, steps: np.ndarray, size: int, nic: np.ndarray, topo) -> int:
    """Adds the NIC bytes of a routed hop's transfers of `steps` rows each; returns
    its intra-node (dispatch + combine) bytes."""
    senders, receivers = route.send_proxies, route.recv_proxies
    if len(senders) != len(receivers):  # ranges differ: intersect them step by step
        intra = 0
        for rows in steps.tolist():
            hop = Route(route.src, route.dst, rows, senders, receivers)
            intra += (hop.dispatched_rows() + hop.combined_rows()) * size
            for piece in hop.pieces():
                nic[topo.node_of(piece.sender), topo.nic_of(piece.sender)] += (
                    piece.hi - piece.lo
                ) * size
        return intra
    count = len(senders)
    base, extra = steps // count, steps % count
    shares = base[:, None] + (np.arange(count)[None, :] < extra[:, None])  # steps x proxies
    carried = shares.sum(axis=0)
    for k, proxy in enumerate(senders):
        nic[topo.node_of(proxy), topo.nic_of(proxy)] += int(carried[k]) * size
    total = int(steps.sum())
    own_send = int(carried[senders.index(route.src)])
    own_recv = int(carried[receivers.index(route.dst)])
    return (2 * total - own_send - own_recv) * size
