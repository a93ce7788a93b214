"""What a plan costs: tokens, attention FLOPs and bytes per rank and link kind.

All figures are for the forward pass of one attention layer. FLOPs count the
causal pairs exactly: query position p of a sequence sees p + 1 keys, and a
pair costs 4 H E FLOPs (QK^T and PV). A Ulysses member computes 1/U of its ring
position's heads.

Bytes are what each rank sends: ring exchange sends the K and V buffer it holds
at each of the R - 1 steps; all-gather moves R - 1 padded buffers per rank (ring
algorithm); Ulysses sends Q, K, V to the other members before attention and the
output back after it. Each exchange kind's rows and time are its own
(`ExchangeKind.carried_tokens` and `layer_seconds`, `ray_zep.partition.exchange`).

`seconds` is a first-order model of one layer's forward attention time per
rank: the ranks of a queue item wait for its slowest member; a ring member
computes its diagonal step, then R - 1 steps each lasting the longer of its
share of the compute and the transfer of the largest position's K and V over
the ring's slowest link (compute and transfer overlap, as in the engine; a
ring crosses each node boundary from one GPU, which has its NIC alone); an
all-gather or Ulysses exchange is not overlapped. A rank runs its items one
after another, so a layer takes the maximum over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_zep.costmodel import (
    BYTES_PER_ELEMENT,
    CostModel,
    kv_bytes_per_token,
    linear_flops_per_token,
    q_bytes_per_token,
)
from ray_zep.model_shapes import ModelShape
from ray_zep.partition.exchange import ExchangeKind
from ray_zep.partition.member_arrays import plain_members
from ray_zep.partition.plan import AttentionPlan, QueueItem, SeqPlacement, link_kind
from ray_zep.topology import LinkKind


@dataclass
class PlanStats:
    """Per-rank cost of a plan.

    Attributes:
        tokens: tokens per rank.
        attention_flops: forward attention FLOPs per rank, one layer.
        sent_bytes: bytes each rank sends per link kind, forward, one layer.
        zones: for each rank, its tokens per zone value.
        seconds: modelled forward attention time per rank, one layer.
        collective_bytes: the part of `sent_bytes` moved by all-gathers and
            Ulysses exchanges (not ring point-to-point, which routing may carry).
    """

    tokens: np.ndarray
    attention_flops: np.ndarray
    sent_bytes: dict[LinkKind, np.ndarray]
    zones: list[dict[str, int]]
    seconds: np.ndarray
    collective_bytes: dict[LinkKind, np.ndarray]
    work_flops: np.ndarray
    """Per rank, a step's forward + backward FLOPs of every layer: linear modules on its
    tokens plus its attention, each x 3 (what the planners balance, counted in FLOPs)."""

    def work_imbalance(self) -> float:
        """Max over mean of `work_flops` (1.0 is perfect balance)."""
        return max_over_mean(self.work_flops)

    def imbalance(self) -> float:
        """Max over mean of attention FLOPs (1.0 is perfect balance)."""
        return max_over_mean(self.attention_flops)

    def total_bytes(self, kind: LinkKind) -> int:
        return int(self.sent_bytes[kind].sum())

    @property
    def layer_seconds(self) -> float:
        """Modelled forward attention time of one layer: the slowest rank."""
        return float(self.seconds.max()) if self.seconds.size else 0.0


def max_over_mean(values: np.ndarray) -> float:
    """Largest value over the mean (1.0 for an all-zero array)."""
    mean = float(values.mean())
    return float(values.max()) / mean if mean > 0 else 1.0


def visible_pairs(start: int, end: int) -> int:
    """Causal (query, key) pairs of query positions [start, end) of one sequence."""
    return (end * (end + 1) - start * (start + 1)) // 2


def plan_stats(plan: AttentionPlan, shape: ModelShape) -> PlanStats:
    """Tokens, FLOPs, bytes and modelled time of every rank under `plan` for `shape`."""
    world = plan.world
    cost = CostModel.create(shape, plan.topology)
    tokens = plan.rank_tokens()
    flops = np.zeros(world, dtype=np.float64)
    seconds = np.zeros(world, dtype=np.float64)
    sent = {kind: np.zeros(world, dtype=np.int64) for kind in LinkKind}
    collective = {kind: np.zeros(world, dtype=np.int64) for kind in LinkKind}
    items = plan.items()
    sums = _Sums(flops, seconds, sent, collective)
    plain = [item for item in items if item.ulysses == 1]
    zones = _add_plain_items(plan, plain, shape, cost, sums) if plain else []
    if len(plain) < len(items):  # Ulysses items (a USP group's), member by member
        heads = _add_items(plan, [item for item in items if item.ulysses > 1], shape, cost, sums)
        zones = _merged(zones, heads) if zones else heads
    before, after = linear_flops_per_token(shape)
    work = 3.0 * shape.n_layers * (tokens * (before + after) + flops)
    return PlanStats(tokens, flops, sent, zones, seconds, collective, work)


@dataclass(frozen=True)
class _Sums:
    """The per-rank arrays `plan_stats` adds every item to."""

    flops: np.ndarray
    seconds: np.ndarray
    sent: dict[LinkKind, np.ndarray]
    collective: dict[LinkKind, np.ndarray]


def _merged(zones: list[dict[str, int]], more: list[dict[str, int]]) -> list[dict[str, int]]:
    """Each rank's tokens per zone of both lists, summed."""
    for mine, theirs in zip(zones, more, strict=True):
        for zone, held in theirs.items():
            mine[zone] = mine.get(zone, 0) + held
    return zones


def _add_items(
    plan: AttentionPlan, items: list[QueueItem], shape: ModelShape, cost: CostModel, sums: _Sums
) -> list[dict[str, int]]:
    """Adds each item, member by member (any item, Ulysses ones included); returns
    each rank's tokens per zone."""
    zones: list[dict[str, int]] = [{} for _ in range(plan.world)]
    pair_flops = 4.0 * shape.n_heads * shape.head_dim
    for item in items:
        placements = [plan.placement(s) for s in item.seqs]
        member_flops = []
        for member, rank in enumerate(item.ranks):
            held = sum(p.member_tokens(member) for p in placements)
            zones[rank][item.zone.value] = zones[rank].get(item.zone.value, 0) + held
            position = member // item.ulysses
            pairs = sum(
                visible_pairs(a, b) for p in placements for a, b in p.position_ranges(position)
            )
            member_flops.append(pair_flops * pairs / item.ulysses)
        sums.flops[list(item.ranks)] += member_flops
        exchange_bytes = _add_item_bytes(plan, item, placements, shape, sums.sent, sums.collective)
        sums.seconds[list(item.ranks)] += _item_seconds(
            item, cost, max(member_flops), exchange_bytes
        )
    return zones


def _add_plain_items(
    plan: AttentionPlan, items: list[QueueItem], shape: ModelShape, cost: CostModel, sums: _Sums
) -> list[dict[str, int]]:
    """`_add_items` of Ulysses-free items, all members at once (`member_arrays`): the
    same sums, added rank by rank in the same order."""
    members = plain_members(plan, items)
    item, rank = members.item, members.rank
    member_flops = 4.0 * shape.n_heads * shape.head_dim * members.pairs
    np.add.at(sums.flops, rank, member_flops)
    kinds = [it.exchange_kind for it in items]
    node = rank // plan.topology.gpus_per_node
    after = members.next_member()
    crosses = node != node[after]
    widest = members.per_item(members.tokens, np.maximum)
    total = members.per_item(members.tokens, np.add)
    ring = members.ring[item]
    kv_token = kv_bytes_per_token(shape)
    carried = np.zeros(len(item), dtype=np.int64)
    for exchange, has_it in _kind_masks(kinds):
        carried = np.where(
            has_it[item],
            exchange.carried_tokens(total[item], widest[item], members.tokens[after], ring),
            carried,
        )
    collective = np.asarray([exchange.collective for exchange in kinds])
    for kind, links in ((LinkKind.INTER_NODE, crosses), (LinkKind.INTRA_NODE, ~crosses)):
        sends = links & (ring > 1)
        np.add.at(sums.sent[kind], rank[sends], carried[sends] * kv_token)
        gathers = sends & collective[item]
        np.add.at(sums.collective[kind], rank[gathers], carried[gathers] * kv_token)
    inter = members.per_item(node, np.minimum) != members.per_item(node, np.maximum)
    compute = cost.attention_seconds(members.per_item(member_flops, np.maximum))
    seconds = _plain_item_seconds(cost, compute, members.ring, widest * kv_token, inter, kinds)
    np.add.at(sums.seconds, rank, seconds[item])
    zones: list[dict[str, int]] = [{} for _ in range(plan.world)]
    values = [it.zone.value for it in items]
    for value in dict.fromkeys(values):  # the zones in execution order, as `_add_items`
        mine = np.asarray([v == value for v in values])[item]
        held = np.zeros(plan.world, dtype=np.int64)
        np.add.at(held, rank[mine], members.tokens[mine])
        for r in np.unique(rank[mine]).tolist():
            zones[r][value] = int(held[r])
    return zones


def _plain_item_seconds(
    cost: CostModel,
    compute: np.ndarray,
    ring: np.ndarray,
    step_bytes: np.ndarray,
    inter: np.ndarray,
    kinds: list[ExchangeKind],
) -> np.ndarray:
    """`_item_seconds` of Ulysses-free items (nothing to exchange between heads), on arrays."""

    def transfer(one_sender_per_nic: bool) -> np.ndarray:
        links = (LinkKind.INTER_NODE, LinkKind.INTRA_NODE)
        latency = np.where(inter, *(cost.link_latency(k) for k in links))
        bandwidth = np.where(inter, *(cost.link_bandwidth(k, one_sender_per_nic) for k in links))
        return np.where(step_bytes > 0, latency + step_bytes / bandwidth, 0.0)

    seconds = compute
    for exchange, has_it in _kind_masks(kinds):
        step = transfer(exchange.one_sender_per_nic)
        seconds = np.where(has_it, exchange.layer_seconds(compute, step, ring), seconds)
    return np.where(ring == 1, compute, seconds)


def _kind_masks(kinds: list[ExchangeKind]):
    """(kind, which items have it) of every kind among the items' `kinds`."""
    for kind in dict.fromkeys(kinds):
        yield kind, np.asarray([k is kind for k in kinds])


def _item_seconds(item: QueueItem, cost: CostModel, flops: float, exchange: _Exchanged) -> float:
    """Modelled time of one queue item, set by its busiest member (see the module doc)."""
    compute = cost.attention_seconds(flops)
    kind = _slowest_link(item, cost)
    heads = cost.transfer_seconds(exchange.all_to_all_bytes, kind)
    if item.ring_size == 1:
        return compute + heads
    exchange_kind = item.exchange_kind
    step = cost.transfer_seconds(
        exchange.step_bytes, kind, one_sender_per_nic=exchange_kind.one_sender_per_nic
    )
    return exchange_kind.layer_seconds(compute, step, item.ring_size, heads)


def _slowest_link(item: QueueItem, cost: CostModel) -> LinkKind:
    nodes = np.asarray(item.ranks) // cost.topology.gpus_per_node
    return LinkKind.INTER_NODE if nodes.min() != nodes.max() else LinkKind.INTRA_NODE


@dataclass(frozen=True)
class _Exchanged:
    """Largest per-rank message sizes of one queue item."""

    step_bytes: int
    """K and V of the largest ring position (one ring step or all-gather block)."""
    all_to_all_bytes: int
    """Ulysses bytes sent by the busiest member."""


def _add_item_bytes(
    plan: AttentionPlan,
    item: QueueItem,
    placements: list[SeqPlacement],
    shape: ModelShape,
    sent: dict[LinkKind, np.ndarray],
    collective: dict[LinkKind, np.ndarray],
) -> _Exchanged:
    topo = plan.topology
    u_size, ring = item.ulysses, item.ring_size
    position_tokens = plan.position_tokens(item)
    kv_token = (
        kv_bytes_per_token(shape) // u_size
        if u_size <= shape.n_kv_heads
        else (2 * shape.head_dim * BYTES_PER_ELEMENT)
    )
    exchange = item.exchange_kind
    total, widest = sum(position_tokens), max(position_tokens)
    busiest = 0
    for member, rank in enumerate(item.ranks):
        position, part = divmod(member, u_size)
        if ring > 1:
            following = (position + 1) % ring
            link = link_kind(rank, item.ranks[following * u_size + part], topo)
            carried = exchange.carried_tokens(total, widest, position_tokens[following], ring)
            if exchange.collective:
                collective[link][rank] += carried * kv_token
            sent[link][rank] += carried * kv_token
        if u_size > 1:
            held = sum(p.member_tokens(member) for p in placements)
            per_peer = held * (2 * q_bytes_per_token(shape) + u_size * kv_token) // u_size
            busiest = max(busiest, per_peer * (u_size - 1))
            for other in range(u_size):
                if other != part:
                    peer = item.ranks[position * u_size + other]
                    sent[link_kind(rank, peer, topo)][rank] += per_peer
                    collective[link_kind(rank, peer, topo)][rank] += per_peer
    return _Exchanged(widest * kv_token, busiest)
