"""Trimmed ring messages: a message carries only the layout slots its receiver and the
receivers after it select (`Layout.carried_slots`); zeppelin's rings cut sequences with
the mirrored zigzag, whose messages carry half a block once it has passed the ring's
last position, and put the rest of a ring across nodes first."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from ray_zep.attention.schedule import RankSchedule
from ray_zep.config import load_config
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import Placement
from ray_zep.partition.balance import _rest_first
from ray_zep.partition.carried import Carried
from ray_zep.partition.exchange import Exchange
from ray_zep.partition.layout import MIRRORED_ZIGZAG, ZIGZAG
from ray_zep.partition.plan import AttentionPlan, SeqPlacement, local_placement
from ray_zep.partition.stats import plan_stats
from ray_zep.routing.routes import Payload, RoutingPlan
from ray_zep.topology import build_topology
from tests.helpers.attention import reference, ring_rank
from tests.helpers.procs import run_ranks

LENGTHS = [37, 23, 5, 50, 9, 2]
HEADS, KV_HEADS, DIM = 8, 2, 4


def _placements(ulysses: bool = True) -> list[SeqPlacement]:
    """On 2 nodes x 2 GPUs: two sequences on one ring of three ranks, the rest of node 1
    first (rank 2, then node 0's ranks 0 and 1); a Ulysses group of two positions (node 1,
    then node 0), or without `ulysses` a third sequence on that ring; a ring inside node
    0; two whole sequences on rank 3."""
    mirrored = MIRRORED_ZIGZAG
    across = (2, 0, 1)
    if ulysses:
        group = SeqPlacement(3, 50, (2, 3, 0, 1), mirrored.bounds_for_counts([25, 25]),
                             ulysses=2, parts=(12, 13, 12, 13), layout=mirrored)  # fmt: skip
    else:
        group = SeqPlacement(3, 50, across, mirrored.bounds_for_counts([23, 13, 14]),
                             layout=mirrored)  # fmt: skip
    return [
        SeqPlacement(0, 37, across, mirrored.bounds_for_counts([10, 14, 13]), layout=mirrored),
        SeqPlacement(1, 23, across, mirrored.bounds_for_counts([7, 8, 8]), layout=mirrored),
        local_placement(2, 5, 3),
        group,
        SeqPlacement(4, 9, (0, 1), mirrored.bounds_for_counts([4, 5]), layout=mirrored),
        local_placement(5, 2, 3),
    ]


def _config():
    return load_config(None, ["topology.nodes=2", "topology.gpus_per_node=2",
                              f"model.n_heads={HEADS}", f"model.n_kv_heads={KV_HEADS}",
                              f"model.dim={HEADS * DIM}"])  # fmt: skip


def _plan(exchange: Exchange = Exchange.RING, ulysses: bool = True) -> AttentionPlan:
    plan = AttentionPlan(Placement.ZEPPELIN, build_topology(_config().topology), 40,
                         tuple(_placements(ulysses)))  # fmt: skip
    plan.validate()
    return plan.with_exchange(set(range(len(LENGTHS))), exchange)


@pytest.mark.unit
def test_a_mirrored_message_carries_half_a_block_after_the_wrap() -> None:
    """A block of owner j reaches j + 1 .. R - 1 whole (they attend to all of it), then,
    past the last position, 0 .. j - 1 with its early chunk alone (all they attend to);
    the first position receives nothing but early chunks. Zigzag sends whole blocks, as
    Transformer Engine and PyTorch do."""
    ring = 5
    for owner in range(ring):
        for receiver in range(ring):
            if receiver == owner:
                continue
            carried = MIRRORED_ZIGZAG.carried_slots(ring, receiver, owner)
            assert carried == ((0, 1) if receiver > owner else (0,)), (owner, receiver)
            assert ZIGZAG.carried_slots(ring, receiver, owner) == (0, 1)
    rng = np.random.default_rng(0)
    for layout in (MIRRORED_ZIGZAG, ZIGZAG):
        for ring in (2, 3, 6):
            tokens = rng.integers(0, 30, size=(ring, 2))
            carried = Carried.of(tokens, layout)
            sent = np.zeros(ring, dtype=np.int64)
            for p in range(ring):  # after step s, position p sends p - s's block to p + 1
                for s in range(ring - 1):
                    owner, receiver = (p - s) % ring, (p + 1) % ring
                    slots = list(layout.carried_slots(ring, receiver, owner))
                    rows = int(tokens[owner, slots].sum())
                    assert carried.rows(receiver, owner) == rows
                    sent[p] += rows
            assert (carried.sent() == sent).all(), (layout.name, ring)
            table = layout.chunk_table(ring)  # the chunks each position holds, kept
            assert table.tolist() == [layout.position_chunks(ring, p) for p in range(ring)]
            assert layout.chunk_table(ring) is table and not table.flags.writeable


@pytest.mark.unit
def test_routing_the_schedule_and_the_byte_counts_carry_the_same_trimmed_rows() -> None:
    """The rows each K/V transfer lists are the rows the receiving schedule's step holds,
    fewer than the block wherever its message passed the wrap, and they add up to the
    plan statistics' bytes (rings alone: Ulysses members also send rows to their peers)."""
    plan = _plan(ulysses=False)
    routing = RoutingPlan.build(plan, routed=False, all_hops=True)
    listed = Counter()
    trimmed = 0
    held = {}
    for rank in range(plan.world):
        for item in RankSchedule.build(plan, rank).items:
            for s in range(1, item.item.ring_size):
                held[(item.item.ranks, rank, s)] = item.held_rows(s)
                whole = item.position_tokens[item.steps[s].source]
                trimmed += item.held_rows(s) < whole
    for t in routing.forward:
        assert t.payload is Payload.KV
        step = t.order[1] + 1  # sent after step s, held at s + 1
        assert held[(t.item_key[0], t.route.dst, step)] == t.route.rows
        listed[t.route.src] += t.route.rows
    assert trimmed > 0, "no message was trimmed"
    shape = build_shape(_config().model)
    stats = plan_stats(plan, shape)
    sent = sum(stats.sent_bytes.values())
    row_bytes = 2 * shape.n_kv_heads * shape.head_dim * 2  # K and V, bf16
    assert sum(listed.values()) > 0
    for rank in range(plan.world):
        assert sent[rank] == listed[rank] * row_bytes, rank


@pytest.mark.unit
def test_the_rest_of_a_ring_across_nodes_comes_first() -> None:
    """A ring of whole nodes and a rest starts on the rest's first position after another
    node's, so every message into the rest's node is half a block; a ring whose nodes hold
    as many positions each, or inside one node, keeps its order."""
    gpus = 4
    assert _rest_first((0, 1, 2, 3, 4, 5), 1, gpus) == 4
    assert _rest_first((4, 5, 8, 9, 10, 11), 1, gpus) == 0
    assert _rest_first((0, 1, 2, 3, 4, 5, 6, 7), 2, gpus) == 0
    assert _rest_first((0, 1, 2, 3, 8, 9), 2, gpus) == 2
    assert _rest_first((0, 1, 2), 1, gpus) == 0


def _case(exchange: Exchange, owner: bool, routed: bool) -> dict:
    return dict(strategy="zeppelin", placements=_placements(), exchange=exchange.value,
                dkv_to_owner=owner, routing=routed, nodes=2, gpus=2, heads=HEADS,
                kv_heads=KV_HEADS, dim=DIM, lengths=LENGTHS, capacity=40)  # fmt: skip


def _all(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [ring_rank(rank, world, case) for case in cases]


@pytest.mark.dist
def test_trimmed_rings_still_equal_one_device() -> None:
    """2x2, fp32: mirrored rings across nodes and inside one, and a Ulysses group, each
    sending trimmed messages, forward and backward, rotating their K/V again or keeping
    them, dK/dV passed round as accumulators or sent to their owners, direct or routed:
    one device's outputs and gradients (rel 1e-5), and the calls the schedule counts."""
    cases = [_case(Exchange.RING, False, False), _case(Exchange.RING_KEPT, False, False),
             _case(Exchange.RING, True, False), _case(Exchange.RING_KEPT, True, False),
             _case(Exchange.RING, False, True), _case(Exchange.RING_KEPT, False, True)]  # fmt: skip
    results = run_ranks(_all, 4, cases)
    q, k, v, _, out = reference(LENGTHS, HEADS, KV_HEADS, DIM, 0)
    expected = {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for index, case in enumerate(cases):
        name = f"{case['exchange']} owner={case['dkv_to_owner']} routed={case['routing']}"
        for rank, per_rank in enumerate(results):
            got = per_rank[index]
            rows = torch.as_tensor(got["rows"])
            n = len(rows)
            for what, ref in expected.items():
                error = float((got[what][:n] - ref[rows]).abs().max())
                assert error <= 1e-5 * float(ref.abs().max()), f"{name} rank {rank} {what}"
            assert got["ops"] == got["expected_ops"], f"{name} rank {rank}"
