"""Routes of inter-node ring transfers through proxy ranks (pure computation).

A ring transfer of n rows from rank a (node A) to its ring successor b (node B)
is split into three hops:

1. dispatch (intra-node): a scatters the rows to x1 send proxies on A, proxy k
   taking the k-th of x1 near-equal row ranges (a keeps its own range when it
   is a proxy itself);
2. inter-node: send proxy k sends, through its own NIC, the rows its range
   shares with receive proxy j's range (one of x2 near-equal ranges on B);
3. combine (intra-node): receive proxy j forwards its range to b (b keeps the
   part it received itself when it is a proxy).

With x1 == x2 (the planner's rule) the ranges coincide and proxy k pairs with
proxy j = k; unequal counts are supported, the inter-node pieces then being
the non-empty intersections of the two splits. Any GPU of a node may proxy,
also one busy with local or intra-node work: its relay thread forwards while
it computes (`ray_zep.routing.relay`).

Proxy rule (Zeppelin §3.3): x = min(GPUs of the source node, GPUs of the
destination node) proxies per side, taken NIC by NIC (the first proxies sit on
distinct NICs), the source or destination itself always among them. When k
hops of one ring step go between the same two nodes (a Ulysses x ring group
runs U rings side by side), each gets x / k proxies and no proxy is shared, so
rings whose GPUs already all send across nodes stay direct.

Rows are token rows of a position's K/V (or dK/dV) buffer.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from ray_zep.partition.plan import AttentionPlan, QueueItem
from ray_zep.topology import Topology


class Payload(IntEnum):
    """What a ring transfer carries (the value orders transfers within a step)."""

    KV = 0
    """K and V in the compute dtype (forward, and again in backward)."""
    DKV = 1
    """dK/dV accumulators, float32 (backward only)."""


class Phase(IntEnum):
    FORWARD = 0
    BACKWARD = 1


def split_rows(rows: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous near-equal ranges covering [0, rows) (the first get the extra rows)."""
    base, extra = divmod(rows, parts)
    bounds = [0, *itertools.accumulate(base + (k < extra) for k in range(parts))]
    return list(itertools.pairwise(bounds))


@dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) of a transfer, sent over the inter-node link from `sender` to `receiver`."""

    sender: int
    receiver: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Route:
    """How one transfer of `rows` rows travels from `src` to `dst`.

    Attributes:
        src, dst: global ranks on different nodes.
        rows: token rows of the transfer.
        send_proxies: x1 ranks on src's node; proxy k carries `send_ranges[k]`.
        recv_proxies: x2 ranks on dst's node; proxy j collects `recv_ranges[j]`.
    """

    src: int
    dst: int
    rows: int
    send_proxies: tuple[int, ...]
    recv_proxies: tuple[int, ...]

    @property
    def direct(self) -> bool:
        return self.send_proxies == (self.src,) and self.recv_proxies == (self.dst,)

    @property
    def send_ranges(self) -> list[tuple[int, int]]:
        return split_rows(self.rows, len(self.send_proxies))

    @property
    def recv_ranges(self) -> list[tuple[int, int]]:
        return split_rows(self.rows, len(self.recv_proxies))

    def pieces(self) -> list[Piece]:
        """Non-empty inter-node pieces, sender-major."""
        out = []
        for sender, (a, b) in zip(self.send_proxies, self.send_ranges, strict=True):
            for receiver, (c, d) in zip(self.recv_proxies, self.recv_ranges, strict=True):
                lo, hi = max(a, c), min(b, d)
                if hi > lo:
                    out.append(Piece(sender, receiver, lo, hi))
        return out

    def source_messages(self) -> int:
        """Messages the source posts: dispatches to other proxies and its own pieces."""
        ranges = zip(self.send_proxies, self.send_ranges, strict=True)
        dispatched = sum(1 for k, (a, b) in ranges if k != self.src and b > a)
        return dispatched + sum(1 for p in self.pieces() if p.sender == self.src)

    def destination_messages(self) -> int:
        """Messages the destination receives: its own pieces and other proxies' ranges."""
        ranges = zip(self.recv_proxies, self.recv_ranges, strict=True)
        combined = sum(1 for j, (a, b) in ranges if j != self.dst and b > a)
        return combined + sum(1 for p in self.pieces() if p.receiver == self.dst)

    def dispatched_rows(self) -> int:
        """Rows the source hands to other send proxies (intra-node hop 1)."""
        ranges = zip(self.send_proxies, self.send_ranges, strict=True)
        return sum(b - a for k, (a, b) in ranges if k != self.src)

    def combined_rows(self) -> int:
        """Rows other receive proxies hand to the destination (intra-node hop 3)."""
        ranges = zip(self.recv_proxies, self.recv_ranges, strict=True)
        return sum(b - a for j, (a, b) in ranges if j != self.dst)


def choose_proxies(
    topology: Topology, endpoint: int, count: int, busy: tuple[int, ...] = ()
) -> tuple[int, ...]:
    """`count` proxies on `endpoint`'s node, spread over NICs, `endpoint` among them.

    `busy` are the endpoints of the other transfers that leave (or reach) the
    node in the same ring step: each keeps its own GPU, and the node's other GPUs
    are dealt to the transfers in turn, so concurrent transfers share no proxy.
    Every node has the same GPUs and NICs, so the choice is made once per position on
    a node (`_local_proxies`) and reused on every node.
    """
    base = topology.node_of(endpoint) * topology.gpus_per_node
    for rank in busy:
        if topology.node_of(rank) != topology.node_of(endpoint):
            raise ValueError(f"busy rank {rank} is not on rank {endpoint}'s node")
    local = _local_proxies(topology.gpu_to_nic, topology.nics_per_node, endpoint - base,
                           count, frozenset(r - base for r in busy))  # fmt: skip
    return tuple(base + g for g in local)


@functools.lru_cache(maxsize=4096)
def _nic_ordered(gpu_to_nic: tuple[int, ...], nics: int) -> tuple[int, ...]:
    """A node's local GPU indices, one per NIC in turn (NIC 0's first GPU, NIC 1's first
    GPU, ...)."""
    by_nic = [[g for g, n in enumerate(gpu_to_nic) if n == nic] for nic in range(nics)]
    return tuple(g for layer in itertools.zip_longest(*by_nic) for g in layer if g is not None)


@functools.lru_cache(maxsize=4096)
def _local_proxies(
    gpu_to_nic: tuple[int, ...], nics: int, endpoint: int, count: int, busy: frozenset[int]
) -> tuple[int, ...]:
    """`choose_proxies` on a node's local GPU indices (`gpu_to_nic`: each one's NIC)."""
    ordered = list(_nic_ordered(gpu_to_nic, nics))
    if busy:
        endpoints = sorted({endpoint, *busy}, key=ordered.index)
        ordered = _deal(gpu_to_nic, ordered, endpoints)[endpoint]
    chosen = ordered[:count]
    if endpoint not in chosen:
        same_nic = [g for g in chosen if gpu_to_nic[g] == gpu_to_nic[endpoint]]
        chosen[chosen.index(same_nic[0] if same_nic else chosen[-1])] = endpoint
    return tuple(sorted(chosen, key=ordered.index))


def _deal(
    gpu_to_nic: tuple[int, ...], ordered: list[int], endpoints: list[int]
) -> dict[int, list[int]]:
    """Each endpoint plus a share of the other GPUs: a GPU goes to the smallest group
    whose NICs do not include its own yet (else to the smallest group)."""
    groups = {e: [e] for e in endpoints}
    for gpu in (g for g in ordered if g not in groups):
        nic = gpu_to_nic[gpu]
        fresh = [e for e in endpoints if nic not in {gpu_to_nic[g] for g in groups[e]}]
        target = min(fresh or endpoints, key=lambda e: (len(groups[e]), endpoints.index(e)))
        groups[target].append(gpu)
    return groups


def plan_route(
    topology: Topology,
    src: int,
    dst: int,
    rows: int,
    senders: tuple[int, ...] = (),
    receivers: tuple[int, ...] = (),
) -> Route:
    """The proxy route of a transfer between two nodes (the module's proxy rule).

    `senders` / `receivers`: sources of the transfers leaving src's node and
    destinations of those reaching dst's node in the same step (this one
    included); the node's GPUs are shared among them.
    """
    count = proxy_count(topology, src, dst, senders, receivers)
    if count == 1:  # as many transfers as GPUs (a USP group's hops): each goes direct
        return Route(src, dst, rows, (src,), (dst,))
    return Route(
        src,
        dst,
        rows,
        choose_proxies(topology, src, count, tuple(r for r in senders if r != src)),
        choose_proxies(topology, dst, count, tuple(r for r in receivers if r != dst)),
    )


def proxy_count(
    topology: Topology, src: int, dst: int, senders: tuple[int, ...], receivers: tuple[int, ...]
) -> int:
    """Proxies on each side of a transfer between two nodes (`plan_route`): the nodes'
    GPUs shared among the transfers leaving and reaching them in the same step."""
    share = max(1, len(set(senders) | {src}), len(set(receivers) | {dst}))
    src_gpus = len(topology.ranks_of_node(topology.node_of(src)))
    dst_gpus = len(topology.ranks_of_node(topology.node_of(dst)))
    return max(1, min(src_gpus, dst_gpus) // share)


def _shared_route(topology: Topology, src: int, dst: int, rows: int, crossing) -> Route:
    """`plan_route` with the proxies shared among the ring's hops between the same nodes
    (`crossing`: `crossing_hops`)."""
    senders, receivers = crossing[(topology.node_of(src), topology.node_of(dst))]
    return plan_route(topology, src, dst, rows, senders, receivers)


def _direct(topology: Topology, src: int, dst: int, rows: int) -> Route:
    return Route(src, dst, rows, (src,), (dst,))


@dataclass(frozen=True)
class Transfer:
    """One inter-node ring transfer of one layer call.

    Attributes:
        order: (item index in the plan's execution order, ring step, payload):
            every rank and relay handles transfers in this order.
        item_key: (ranks, ulysses) of the queue item, as its schedule knows it.
        ulysses: U of the item (sets the K/V heads a row carries).
        route: how the rows travel.
    """

    order: tuple[int, int, int]
    item_key: tuple[tuple[int, ...], int]
    ulysses: int
    route: Route

    @property
    def step(self) -> int:
        return self.order[1]

    @property
    def payload(self) -> Payload:
        return Payload(self.order[2])

    def lookup_key(self) -> tuple:
        return (self.item_key, self.step, self.payload, self.route.src)


def item_transfers(
    plan: AttentionPlan,
    index: int,
    item: QueueItem,
    phase: Phase,
    routed: bool,
    all_hops: bool = False,
) -> list[Transfer]:
    """Inter-node transfers of a ring item in one phase, in handling order (with
    `all_hops`, intra-node hops too, as direct routes: for byte accounting)."""
    hops = itemhop_routes(plan.topology, item, routed, all_hops)
    return listed_transfers(plan, index, item, hops, phase) if hops else []


def itemhop_routes(
    topo: Topology, item: QueueItem, routed: bool, all_hops: bool = False
) -> list[tuple[int, Route]]:
    """(position, route of no rows yet) of each listed hop of a ring item: a hop keeps
    its proxies at every step, only the rows it carries change. Inter-node hops only,
    unless `all_hops`; none for an item that never sends around a ring (one position,
    or an exchange kind that is not `routable`). Worked out once per item (the routing
    plan and the byte count of a step both ask for them)."""
    if item.ring_size < 2 or not item.exchange_kind.routable:
        return []
    return list(_itemhop_routes(topo, item, routed, all_hops))


@functools.lru_cache(maxsize=4096)
def _itemhop_routes(
    topo: Topology, item: QueueItem, routed: bool, all_hops: bool
) -> tuple[tuple[int, Route], ...]:
    crossing = crossing_hops(item, topo)
    if not crossing and not all_hops:
        return ()  # a ring inside one node has no inter-node transfer
    return tuple(
        (position, hop_route(topo, src, dst, routed, crossing))
        for position, src, dst in item.hops()
        if all_hops or topo.node_of(src) != topo.node_of(dst)
    )


def listed_transfers(
    plan: AttentionPlan,
    index: int,
    item: QueueItem,
    hops: list[tuple[int, Route]],
    phase: Phase,
    dkv_owner: bool = False,
) -> list[Transfer]:
    """Every ring step's transfers over `hops` (`itemhop_routes`) in one phase, in
    handling order: step, then payload, then hop. With `dkv_owner`
    (`parallel.dkv_wire=owner`) an item whose `QueueItem.owner_dkv` holds sends each step
    after the first its dK/dV direct to their owners (`QueueItem.owner_hops`), every one
    of them listed. A ring that kept the forward's K/V sends no accumulator after its own
    block (`ExchangeKind.backward_order`: computed last, each accumulator starting on the
    member after its owner), so its step 0 sends no dK/dV. A K/V message, and a dK/dV
    one sent to its owner, carries the rows of the block its sender held that its layout
    keeps on (`AttentionPlan.carried_tokens`); an accumulator, the whole block."""
    ring, u_size = item.ring_size, item.ulysses
    position_tokens = plan.position_tokens(item)
    positions = np.arange(ring)
    senders = np.asarray([position for position, _ in hops], dtype=np.int64)
    carried = {}  # per step: the K/V rows each hop's sender sends on after that step
    held = {}  # per step: the rows of the block each position held at that step
    payloads = [Payload.KV] if phase is Phase.FORWARD else [Payload.KV, Payload.DKV]
    if phase is Phase.BACKWARD and item.exchange_kind.keeps_kv:
        payloads = [Payload.DKV]  # the forward's K/V were kept
    key = (item.ranks, u_size)
    owner = dkv_owner and item.owner_dkv
    topo = plan.topology
    out = []
    for step in range(ring):
        for payload in payloads:
            if payload is Payload.KV and step == ring - 1:
                continue  # the last step's K/V is never sent on
            if payload is Payload.DKV and owner:
                if not step:
                    continue
                if step not in held:
                    held[step] = plan.carried_tokens(item, positions, (positions - step) % ring)
                out += [Transfer((index, step, int(payload)), key, u_size,
                                 _direct(topo, src, dst, int(held[step][p])))
                        for p, src, dst in item.owner_hops(step)]  # fmt: skip
                continue
            if payload is Payload.DKV and step == 0 and item.exchange_kind.keeps_kv:
                continue  # its own block comes last: no accumulator leaves it
            if payload is Payload.KV and step not in carried:
                carried[step] = plan.carried_tokens(item, (senders + 1) % ring,
                                                    (senders - step) % ring).tolist()  # fmt: skip
            for at, (position, hop) in enumerate(hops):
                if payload is Payload.KV:
                    rows = carried[step][at]
                else:
                    rows = position_tokens[(position - step) % ring]
                route = Route(hop.src, hop.dst, rows, hop.send_proxies, hop.recv_proxies)
                out.append(Transfer((index, step, int(payload)), key, u_size, route))
    return out


def crossing_hops(
    item: QueueItem, topo: Topology
) -> dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...]]]:
    """The item's ring hops between nodes, by (source node, destination node): their
    sources and destinations, in hop order."""
    crossing: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for _, a, b in item.hops():
        pair = (topo.node_of(a), topo.node_of(b))
        if pair[0] != pair[1]:
            senders, receivers = crossing.setdefault(pair, ([], []))
            senders.append(a)
            receivers.append(b)
    return {pair: (tuple(s), tuple(r)) for pair, (s, r) in crossing.items()}


def hop_route(topo: Topology, src: int, dst: int, routed: bool, crossing) -> Route:
    """The route (of no rows yet) a ring hop takes at every step: through proxies when
    `routed` and it crosses nodes, else direct."""
    if routed and topo.node_of(src) != topo.node_of(dst):
        return _shared_route(topo, src, dst, 0, crossing)
    return _direct(topo, src, dst, 0)


@dataclass(frozen=True)
class RankRouting:
    """The routed transfers one rank takes part in, per phase, in handling order."""

    rank: int
    forward: tuple[Transfer, ...]
    backward: tuple[Transfer, ...]

    def transfers(self, phase: Phase) -> tuple[Transfer, ...]:
        return self.forward if phase is Phase.FORWARD else self.backward

    def relayed(self, phase: Phase) -> tuple[Transfer, ...]:
        """Transfers this rank forwards for others (its relay thread's work) in `phase`."""
        me = self.rank
        return tuple(
            t
            for t in self.transfers(phase)
            if (me in t.route.send_proxies and me != t.route.src)
            or (me in t.route.recv_proxies and me != t.route.dst)
        )

    def routes(self) -> dict[tuple, Route]:
        """Route of each transfer this rank sends or receives, by `Transfer.lookup_key`."""
        out = {}
        for t in self.forward + self.backward:
            if self.rank in (t.route.src, t.route.dst):
                out[t.lookup_key()] = t.route
        return out


@dataclass(frozen=True)
class RoutingPlan:
    """Every inter-node ring transfer of one layer's forward and backward.

    `build` decides each hop's route (its proxies) once; the transfers of every ring
    step are listed on demand, for the whole plan (`forward`, `backward`) or for one
    rank's items (`for_rank`), so planning a step does not list the transfers of
    thousands of rings.
    """

    plan: AttentionPlan
    hops: tuple[tuple[int, tuple[tuple[int, Route], ...]], ...]
    """(item index in the plan's execution order, its listed hops (`itemhop_routes`))
    of every item that has any."""
    routed: bool = True
    """Inter-node hops go through proxies (else direct)."""
    dkv_owner: bool = False
    """`parallel.dkv_wire=owner`: the items that may send each step's dK/dV straight to
    its owner do (`listed_transfers`)."""

    @classmethod
    def build(
        cls,
        plan: AttentionPlan,
        routed: bool = True,
        all_hops: bool = False,
        skip: Callable[[QueueItem], bool] | None = None,
        dkv_owner: bool = False,
    ) -> RoutingPlan:
        """Routes for `plan`: through proxies (`routed`) or direct (for comparison);
        `all_hops` adds the intra-node ring hops (direct) for byte accounting; items
        for which `skip` is true are left out (their transfers: `item_transfers`);
        `dkv_owner`: as the field says."""
        topo = plan.topology
        hops = []
        for index, item in enumerate(plan.items()):
            if skip is not None and skip(item):
                continue
            if listed := itemhop_routes(topo, item, routed, all_hops):
                hops.append((index, tuple(listed)))
        return cls(plan, tuple(hops), routed, dkv_owner)

    @property
    def topology(self) -> Topology:
        return self.plan.topology

    @functools.cached_property
    def forward(self) -> tuple[Transfer, ...]:
        return self._listed(Phase.FORWARD, self.hops)

    @functools.cached_property
    def backward(self) -> tuple[Transfer, ...]:
        return self._listed(Phase.BACKWARD, self.hops)

    def _listed(self, phase: Phase, hops) -> tuple[Transfer, ...]:
        items = self.plan.items()
        return tuple(
            t
            for index, listed in hops
            for t in listed_transfers(
                self.plan, index, items[index], list(listed), phase, self.dkv_owner
            )
        )

    @functools.cached_property
    def _routed_items(self) -> dict[int, list]:
        """For each rank, the `hops` entries of the items with a routed hop involving it."""
        out: dict[int, list] = {}
        for entry in self.hops:
            involved = set()
            for _, route in entry[1]:
                if not route.direct:
                    involved.update((route.src, route.dst, *route.send_proxies,
                                     *route.recv_proxies))  # fmt: skip
            for rank in sorted(involved):
                out.setdefault(rank, []).append(entry)
        return out

    def for_rank(self, rank: int) -> RankRouting:
        """The transfers `rank` sends, receives or relays (routed ones only)."""
        mine = self._routed_items.get(rank, ())

        def involving(transfers):
            return tuple(t for t in transfers if not t.route.direct and _involves(t.route, rank))

        forward = involving(self._listed(Phase.FORWARD, mine))
        return RankRouting(rank, forward, involving(self._listed(Phase.BACKWARD, mine)))

    def link_bytes(self, row_bytes: Callable[[Transfer], int]) -> tuple[int, np.ndarray]:
        """Bytes of one layer's forward + backward: over intra-node links (direct
        intra-node hops, dispatch and combine), and leaving each NIC (nodes x NICs).

        Args:
            row_bytes: bytes of one row of a transfer (its K/V heads x head dim x dtype).
        """
        topo = self.topology
        nic = np.zeros((topo.nodes, topo.nics_per_node), dtype=np.int64)
        intra = 0
        for t in self.forward + self.backward:
            size, route = row_bytes(t), t.route
            if topo.node_of(route.src) == topo.node_of(route.dst):
                intra += route.rows * size
                continue
            intra += (route.dispatched_rows() + route.combined_rows()) * size
            for piece in route.pieces():
                where = topo.node_of(piece.sender), topo.nic_of(piece.sender)
                nic[where] += (piece.hi - piece.lo) * size
        return intra, nic


def _involves(route: Route, rank: int) -> bool:
    endpoints = (route.src, route.dst)
    return rank in endpoints or rank in route.send_proxies or rank in route.recv_proxies
