"""What a plan costs: tokens, attention FLOPs and bytes per rank and link kind.

All figures are for the forward pass of one attention layer. FLOPs count the
causal pairs exactly: query position p of a sequence sees p + 1 keys, and a
pair costs 4 H E FLOPs (QK^T and PV). A Ulysses member computes 1/U of its ring
position's heads.

Bytes are what each rank sends: ring exchange sends the K and V buffer it holds
at each of the R - 1 steps; all-gather moves R - 1 padded buffers per rank (ring
algorithm); Ulysses sends Q, K, V to the other members before attention and the
output back after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_zep.costmodel import BYTES_PER_ELEMENT, kv_bytes_per_token, q_bytes_per_token
from ray_zep.model.shapes import ModelShape
from ray_zep.partition.plan import AttentionPlan, Exchange, QueueItem, link_kind
from ray_zep.topology import LinkKind


@dataclass
class PlanStats:
    """Per-rank cost of a plan.

    Attributes:
        tokens: tokens per rank.
        attention_flops: forward attention FLOPs per rank, one layer.
        sent_bytes: bytes each rank sends per link kind, forward, one layer.
        zones: for each rank, its tokens per zone value.
    """

    tokens: np.ndarray
    attention_flops: np.ndarray
    sent_bytes: dict[LinkKind, np.ndarray]
    zones: list[dict[str, int]]

    def imbalance(self) -> float:
        """Max over mean of attention FLOPs (1.0 is perfect balance)."""
        mean = float(self.attention_flops.mean())
        return float(self.attention_flops.max()) / mean if mean > 0 else 1.0

    def total_bytes(self, kind: LinkKind) -> int:
        return int(self.sent_bytes[kind].sum())


def visible_pairs(start: int, end: int) -> int:
    """Causal (query, key) pairs of query positions [start, end) of one sequence."""
    return (end * (end + 1) - start * (start + 1)) // 2


def plan_stats(plan: AttentionPlan, shape: ModelShape) -> PlanStats:
    """Tokens, FLOPs and bytes of every rank under `plan` for a model of `shape`."""
    world = plan.world
    tokens = plan.rank_tokens()
    flops = np.zeros(world, dtype=np.float64)
    sent = {kind: np.zeros(world, dtype=np.int64) for kind in LinkKind}
    zones: list[dict[str, int]] = [{} for _ in range(world)]
    pair_flops = 4.0 * shape.n_heads * shape.head_dim
    for item in plan.items():
        placements = [plan.placement(s) for s in item.seqs]
        for member, rank in enumerate(item.ranks):
            held = sum(p.member_tokens(member) for p in placements)
            zones[rank][item.zone.value] = zones[rank].get(item.zone.value, 0) + held
            position = member // item.ulysses
            pairs = sum(
                visible_pairs(a, b) for p in placements for a, b in p.position_ranges(position)
            )
            flops[rank] += pair_flops * pairs / item.ulysses
        _add_item_bytes(plan, item, shape, sent)
    return PlanStats(tokens, flops, sent, zones)


def _add_item_bytes(
    plan: AttentionPlan, item: QueueItem, shape: ModelShape, sent: dict[LinkKind, np.ndarray]
) -> None:
    topo = plan.topology
    placements = [plan.placement(s) for s in item.seqs]
    u_size, ring = item.ulysses, item.ring_size
    position_tokens = [sum(p.position_tokens(r) for p in placements) for r in range(ring)]
    kv_token = (
        kv_bytes_per_token(shape) // u_size
        if u_size <= shape.n_kv_heads
        else (2 * shape.head_dim * BYTES_PER_ELEMENT)
    )
    for member, rank in enumerate(item.ranks):
        position, part = divmod(member, u_size)
        if ring > 1:
            nxt = item.ranks[((position + 1) % ring) * u_size + part]
            if item.exchange is Exchange.RING:
                carried = sum(position_tokens[(position - s) % ring] for s in range(ring - 1))
            else:
                carried = (ring - 1) * max(position_tokens)
            sent[link_kind(rank, nxt, topo)][rank] += carried * kv_token
        if u_size > 1:
            held = sum(p.member_tokens(member) for p in placements)
            per_peer = held * (2 * q_bytes_per_token(shape) + u_size * kv_token) // u_size
            for other in range(u_size):
                if other != part:
                    peer = item.ranks[position * u_size + other]
                    sent[link_kind(rank, peer, topo)][rank] += per_peer
