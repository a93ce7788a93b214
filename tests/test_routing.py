"""Routing layer: proxy routes (pure) and routed transfers that deliver bit-exact bytes.

The multi-process tests send through hand-made routes on a 2 x 3 virtual
topology: uneven splits (rows not divisible by the proxy count, fewer rows than
proxies), x1 != x2, sources and destinations that are or are not proxies, and
both directions between two nodes in the same ring step.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from ray_zep.collectives.adaptive import AdaptiveCollectives, RingZipper
from ray_zep.collectives.format import Layout, float_format
from ray_zep.config import Compression, ParallelConfig, ZonePolicy, load_config
from ray_zep.distributed import Comm, GroupNeeds
from ray_zep.errors import CodecError, CommError
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import Placement
from ray_zep.partition import make_plan
from ray_zep.routing import relay as routing_comms
from ray_zep.routing.frames import HEAD_BYTES
from ray_zep.routing.link_bytes import ring_link_bytes, routed_hop_bytes
from ray_zep.routing.relay import RowFormat, open_channels, post_recv, post_send
from ray_zep.routing.routes import (
    Payload,
    Phase,
    RankRouting,
    Route,
    RoutingPlan,
    Transfer,
    choose_proxies,
    plan_route,
    split_rows,
)
from ray_zep.topology import build_topology
from ray_zep.traffic import attention_step_traffic, collective_traffic, ring_traffic
from tests.helpers.procs import run_ranks

ROW_SHAPE = (2, 2, 3)  # (K and V, K/V heads, head dim) of a Ulysses-free item


def _topology(preset="virtual", nodes=2, gpus=3, nics=None):
    overrides = [f"topology.preset={preset}", f"topology.nodes={nodes}"]
    if preset == "virtual":
        overrides.append(f"topology.gpus_per_node={gpus}")
    if nics:
        overrides.append(f"topology.nics_per_node={nics}")
    return build_topology(load_config(None, overrides).topology)


@pytest.mark.parametrize("rows,parts", [(10, 3), (7, 2), (2, 3), (0, 4), (9, 9)])
def test_split_rows_tiles_the_transfer(rows: int, parts: int) -> None:
    ranges = split_rows(rows, parts)
    assert len(ranges) == parts and ranges[0][0] == 0 and ranges[-1][1] == rows
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1 and all(a <= b for a, b in ranges)


@pytest.mark.parametrize(
    "send,recv", [((0, 1, 2), (3, 4, 5)), ((0, 2), (3, 4)), ((0, 1, 2), (3, 5)), ((1,), (3, 4))]
)
def test_pieces_cover_every_row_once(send, recv) -> None:
    for rows in (0, 1, 2, 7, 11):
        route = Route(send[0], recv[0], rows, send, recv)
        covered = sorted(r for p in route.pieces() for r in range(p.lo, p.hi))
        assert covered == list(range(rows))
        for p in route.pieces():
            assert p.sender in send and p.receiver in recv


def test_proxies_spread_over_nics_and_include_the_endpoint() -> None:
    topo = _topology("cluster_a", nodes=2)  # 8 GPUs, 4 NICs, GPU pairs share a NIC
    four = choose_proxies(topo, 8 + 5, 4)
    assert 13 in four
    assert sorted(topo.nic_of(r) for r in four) == [0, 1, 2, 3]
    route = plan_route(topo, 7, 8, 100)
    assert len(route.send_proxies) == len(route.recv_proxies) == 8
    assert route.send_proxies[0] != route.send_proxies[1]
    assert 7 in route.send_proxies and 8 in route.recv_proxies


def test_proxies_are_the_same_on_every_node_and_busy_ranks_stay_on_the_node() -> None:
    """`choose_proxies` works on a node's own GPU indices once and shifts them to each
    node: on node 3 it names node 0's choice plus 24, busy transfers included, and a
    busy rank of another node is refused."""
    topo = _topology("cluster_a", nodes=4)
    for endpoint, count, busy in [(5, 4, ()), (2, 2, (0, 6)), (7, 8, ()), (1, 3, (4,))]:
        here = choose_proxies(topo, endpoint, count, busy)
        there = choose_proxies(topo, 24 + endpoint, count, tuple(24 + b for b in busy))
        assert there == tuple(24 + r for r in here) and endpoint in here
        assert len(set(here) & set(busy)) == 0
    with pytest.raises(ValueError, match="busy rank 9"):
        choose_proxies(topo, 2, 2, (9,))


@pytest.mark.parametrize(
    "placement,nodes,lengths",
    [
        (Placement.TE_CP, 2, [5000, 333, 17]),
        (Placement.ZEPPELIN, 3, [30000, 9000, 700, 700, 65, 12000, 3]),
        (Placement.USP, 2, [20000, 4000, 99]),
        (Placement.HYBRID_DP, 3, [25000, 6000, 6000, 800, 40]),
    ],
    ids=lambda v: getattr(v, "value", None),
)
def test_ring_bytes_in_closed_form_equal_the_listed_transfers(placement, nodes, lengths) -> None:
    """`ring_link_bytes` (hop by hop over all steps at once) moves exactly the bytes the
    listed transfers of `RoutingPlan.build(all_hops=True)` do, routed and direct."""
    topo = _topology(nodes=nodes, gpus=8, nics=3)  # 8 GPUs on 3 NICs: uneven proxy counts
    shape = build_shape(load_config(None, ["model.preset=7b"]).model)
    plan = make_plan(placement, lengths, topo, 8192, shape)

    def per_payload(payload: Payload, ulysses: int) -> int:
        return (1024 if payload is Payload.KV else 2048) // ulysses

    for routed in (False, True):
        listed = RoutingPlan.build(plan, routed=routed, all_hops=True)
        intra, nic = listed.link_bytes(lambda t: per_payload(t.payload, t.ulysses))
        got_intra, got_nic = ring_link_bytes(plan, routed, per_payload)
        assert got_intra == intra, f"routed={routed}"
        assert got_nic.tolist() == nic.tolist(), f"routed={routed}"


@pytest.mark.parametrize(
    "send,recv", [((0, 1, 2), (8, 9, 10)), ((0, 1, 2), (8, 9)), ((1, 0), (8,))]
)
def test_routed_hop_bytes_over_all_steps_equal_each_steps_pieces(send, recv) -> None:
    topo = _topology(nodes=2, gpus=8, nics=3)
    steps = np.asarray([0, 1, 2, 7, 11, 100])
    nic = np.zeros((2, 3), dtype=np.int64)
    intra = routed_hop_bytes(Route(send[0], recv[0], 0, send, recv), steps, 3, nic, topo)
    want_nic, want_intra = np.zeros((2, 3), dtype=np.int64), 0
    for rows in steps.tolist():
        route = Route(send[0], recv[0], rows, send, recv)
        want_intra += (route.dispatched_rows() + route.combined_rows()) * 3
        for piece in route.pieces():
            want_nic[0, topo.nic_of(piece.sender)] += (piece.hi - piece.lo) * 3
    assert intra == want_intra
    assert nic.tolist() == want_nic.tolist()


def test_routing_spreads_te_cp_over_every_nic() -> None:
    topo = _topology("cluster_a", nodes=2)
    shape = build_shape(load_config(None, ["model.preset=7b"]).model)
    plan = make_plan(Placement.TE_CP, [65536], topo, 4096, shape)

    def row_bytes(t):
        return 1024 if t.payload is Payload.KV else 2048

    direct = RoutingPlan.build(plan, routed=False).link_bytes(row_bytes)[1]
    routed = RoutingPlan.build(plan, routed=True).link_bytes(row_bytes)[1]
    assert direct.sum() == routed.sum(), "routing moves the same inter-node bytes"
    assert routed.max() * 3 <= direct.max()
    assert (routed > 0).all(), "every NIC carries traffic"


def test_concurrent_hops_share_no_proxy_and_full_rings_stay_direct() -> None:
    topo = _topology("cluster_a", nodes=2)
    a = plan_route(topo, 1, 9, 64, senders=(1, 6), receivers=(9, 14))
    b = plan_route(topo, 6, 14, 64, senders=(1, 6), receivers=(9, 14))
    assert len(a.send_proxies) == len(b.send_proxies) == 4
    assert not set(a.send_proxies) & set(b.send_proxies)
    assert not set(a.recv_proxies) & set(b.recv_proxies)
    assert {topo.nic_of(r) for r in a.send_proxies} == {0, 1, 2, 3}
    shape = build_shape(load_config(None, ["model.preset=7b"]).model)
    usp = make_plan(Placement.USP, [65536], topo, 4096, shape)
    assert not RoutingPlan.build(usp).for_rank(0).forward, "every GPU already sends"


def test_rank_routing_keeps_what_each_rank_does() -> None:
    topo = _topology(nodes=2, gpus=2)
    shape = build_shape(load_config(None, []).model)
    plan = make_plan(Placement.TE_CP, [40, 9], topo, 16, shape)
    routing = RoutingPlan.build(plan)
    for rank in range(4):
        mine = routing.for_rank(rank)
        both = mine.forward + mine.backward
        assert both, f"rank {rank} takes part in routing"
        for t in both:
            route = t.route
            assert rank in (route.src, route.dst, *route.send_proxies, *route.recv_proxies)
        ends = {t.lookup_key() for t in both if rank in (t.route.src, t.route.dst)}
        assert set(mine.routes()) == ends
    orders = [t.order for t in routing.backward]
    assert orders == sorted(orders), "transfers are listed in handling order"


@pytest.mark.parametrize("placement", [Placement.ZEPPELIN, Placement.TE_CP], ids=lambda p: p.value)
def test_a_ranks_transfers_are_the_plans_that_involve_it(placement) -> None:
    """`for_rank` lists only the rings a rank takes part in; its transfers are exactly
    the routed ones of the whole plan's lists that involve the rank, in their order."""
    topo = _topology(nodes=4, gpus=4, nics=2)
    shape = build_shape(load_config(None, ["model.preset=7b"]).model)
    lengths = [30000, 9000, 7000, 3000, 800, 600, 500, 40]
    # the cost policy rings the long sequence over nodes (the work policy runs it as a
    # USP group, whose hops go direct)
    parallel = ParallelConfig(sequence=placement, zone_policy=ZonePolicy.COST)
    plan = make_plan(placement, lengths, topo, 4096, shape, parallel)
    routing = RoutingPlan.build(plan)
    seen = 0
    for rank in range(topo.world_size):
        mine = routing.for_rank(rank)
        for listed, got in ((routing.forward, mine.forward), (routing.backward, mine.backward)):
            expected = [
                t
                for t in listed
                if not t.route.direct
                and rank in (t.route.src, t.route.dst, *t.route.send_proxies, *t.route.recv_proxies)
            ]
            assert list(got) == expected, f"rank {rank}"
            seen += len(got)
    assert seen, "the plan routes something"


# -- multi-process: bit-exact delivery ------------------------------------------------

ROUTES = [
    # ((item, step), payload, route), in handling order
    ((0, 0), Payload.KV, Route(0, 3, 10, (0, 1, 2), (3, 4, 5))),  # endpoints are proxies
    ((0, 0), Payload.KV, Route(1, 5, 7, (0, 2), (3, 4))),  # neither endpoint is a proxy
    ((0, 0), Payload.KV, Route(2, 4, 11, (0, 1, 2), (3, 5))),  # x1 = 3, x2 = 2
    ((0, 0), Payload.KV, Route(4, 0, 2, (3, 4, 5), (0, 1, 2))),  # back, fewer rows than x
    ((0, 0), Payload.DKV, Route(5, 1, 13, (5, 3), (1, 2, 0))),  # x1 = 2, x2 = 3
    ((1, 2), Payload.KV, Route(3, 2, 5, (4,), (2,))),  # one proxy each, source is not it
]


def _payload(index: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + index)
    return torch.randn((rows, *ROW_SHAPE), generator=g).to(dtype)


class _EveryOtherPeer(RingZipper):
    """Zips the messages to even ranks only: plain and zipped frames meet at proxies."""

    def choose(self, stream, peer, tensor):
        return peer % 2 == 0


def _zipper(comm: Comm, framing: str) -> RingZipper | None:
    if framing == "off":
        return None
    zipper = AdaptiveCollectives(comm.world, Compression.ALWAYS).ring_zipper()
    if framing == "mixed":
        zipper.__class__ = _EveryOtherPeer
    return zipper


def _routed_rank(
    rank: int, world: int, kv_dtype: torch.dtype, framing: str = "off", timeout_s: float = 30.0
) -> dict:
    topo = _topology(nodes=2, gpus=3)
    comm = Comm.create(topo, topo.world_size, timeout_s).with_groups(GroupNeeds(routing=True))
    zipper = _zipper(comm, framing)
    channels = open_channels(comm, zipper)
    transfers = [Transfer((*at, int(payload)), ((0,), 1), 1, r) for at, payload, r in ROUTES]
    rows = RowFormat(ROW_SHAPE[1], ROW_SHAPE[2], kv_dtype, torch.device("cpu"))
    relayed = RankRouting(rank, tuple(transfers), ()).relayed(Phase.FORWARD)
    channels.start_relay(relayed, rows)
    received, works, ops = {}, [], Counter()
    for index, t in enumerate(transfers):
        dtype = rows.dtype(t)
        if t.route.src == rank:
            works += post_send(_payload(index, t.route.rows, dtype), t.route, channels, ops)
        if t.route.dst == rank:
            received[index] = rows.empty(t, t.route.rows)
            works += post_recv(received[index], t.route, channels, ops)
    comm.wait(works, "test transfers")
    channels.finish_relay()
    sizes = zipper.tally.peek("routed_kv") if zipper is not None else None
    return {"received": received, "sizes": sizes}


@pytest.mark.dist
@pytest.mark.parametrize(
    ("kv_dtype", "framing"),
    [
        (torch.float32, "off"),
        (torch.bfloat16, "off"),
        (torch.bfloat16, "zipped"),
        (torch.float32, "mixed"),
    ],
    ids=["fp32", "bf16", "bf16-zipped", "fp32-mixed-frames"],
)
def test_routed_transfers_deliver_the_exact_bytes(kv_dtype: torch.dtype, framing: str) -> None:
    """Every route shape, with proxies that forward a piece whole, cut a range into
    pieces (x1 = 3, x2 = 2) or join pieces (x1 = 2, x2 = 3); framed, plain and zipped
    messages meet at the proxies."""
    results = run_ranks(_routed_rank, 6, kv_dtype, framing)
    if framing != "off":  # every hop's message counted once, the relays' too
        raw = sum(r["sizes"][0] for r in results)
        rows = sum(r.dispatched_rows() + r.rows + r.combined_rows() for *_, r in ROUTES)
        element = torch.empty((), dtype=kv_dtype).element_size()
        dkv = sum(r.dispatched_rows() + r.rows + r.combined_rows() for _, p, r in ROUTES if p)
        assert raw == math.prod(ROW_SHAPE) * ((rows - dkv) * element + dkv * 4)
    for index, (_, payload, route) in enumerate(ROUTES):
        dtype = kv_dtype if payload is Payload.KV else torch.float32
        sent = _payload(index, route.rows, dtype)
        got = results[route.dst]["received"][index]
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), sent.view(torch.uint8)), (
            f"transfer {index} ({route.src}->{route.dst}) differs"
        )


def test_step_traffic_counts_what_the_layers_move() -> None:
    topo = _topology("cluster_a", nodes=2)
    shape = build_shape(load_config(None, ["model.preset=7b"]).model)
    plan = make_plan(Placement.TE_CP, [65536, 3000], topo, 5000, shape)
    routed = attention_step_traffic(plan, shape, True, None)
    by_layer = ring_traffic(plan, shape, True) + collective_traffic(plan, shape)
    assert routed.intra_node == by_layer.intra_node * shape.n_layers
    assert (routed.nic == by_layer.nic * shape.n_layers).all()
    direct = attention_step_traffic(plan, shape, False, None)
    assert direct.inter_node == routed.inter_node > 0
    assert direct.intra_node < routed.intra_node, "dispatch and combine hops are intra-node"


def _damaged_frames(rank: int, world: int) -> str:
    """Rank 0 sends every zipped frame with a bit of its first value flipped."""
    honest = routing_comms.frame

    def damaged(tensor, zipped):
        message = honest(tensor, zipped)
        if zipped:  # the first value's raw byte (sign and mantissa)
            layout = Layout.of(tensor.numel(), float_format(tensor.dtype))
            message.frame[HEAD_BYTES + layout.raw] ^= 0x10
        return message

    routing_comms.frame = damaged if rank == 0 else honest
    try:
        _routed_rank(rank, world, torch.bfloat16, "zipped", timeout_s=3.0)
    except (CodecError, CommError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        routing_comms.frame = honest
    return "no error"


@pytest.mark.dist
def test_a_damaged_routed_frame_is_a_typed_error_naming_stream_and_peer() -> None:
    """Rank 0's own piece goes straight to rank 3 (both are proxies): rank 3 decodes it
    and names the stream and rank 0; no rank hangs past comm.timeout_s."""
    errors = run_ranks(_damaged_frames, 6)
    assert errors[3].startswith("CodecError: routed_kv"), errors[3]
    assert "from rank 0" in errors[3], errors[3]
