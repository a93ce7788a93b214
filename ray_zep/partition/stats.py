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
from ray_zep.partition.plan import AttentionPlan, QueueItem, peer_tokens
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
        kept_kv_tokens: per rank, the ring peers' K/V it keeps from the forward for
            the backward (`MemoryInputs.kept_kv_tokens`).
    """

    tokens: np.ndarray
    attention_flops: np.ndarray
    sent_bytes: dict[LinkKind, np.ndarray]
    zones: list[dict[str, int]]
    seconds: np.ndarray
    collective_bytes: dict[LinkKind, np.ndarray]
    work_flops: np.ndarray
    kept_kv_tokens: np.ndarray
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
    tokens = plan.rank_tokens()
    sums, zones = _summed(plan, plan.items(), shape)
    before, after = linear_flops_per_token(shape)
    work = 3.0 * shape.n_layers * (tokens * (before + after) + sums.flops)
    return PlanStats(tokens, sums.flops, sums.sent, zones, sums.seconds, sums.collective, work,
                     kept_kv_tokens(plan))  # fmt: skip


def attention_seconds(plan: AttentionPlan, shape: ModelShape) -> np.ndarray:
    """`plan_stats(plan, shape).seconds` alone (the remap policy's question, every step)."""
    return _summed(plan, plan.items(), shape)[0].seconds


def kept_kv_tokens(plan: AttentionPlan) -> np.ndarray:
    """`PlanStats.kept_kv_tokens` of every rank: in each kept ring, the tokens of the
    positions other than its own, over U."""
    kept = np.zeros(plan.world)
    for item in plan.items():
        if item.ring_size < 2 or not item.exchange_kind.keeps_kv:
            continue
        kept[list(item.ranks)] += peer_tokens(plan.position_tokens(item), item.ulysses)
    return kept


def collective_bytes(plan: AttentionPlan, shape: ModelShape) -> dict[LinkKind, np.ndarray]:
    """`PlanStats.collective_bytes` of `plan`, from its gathering and Ulysses items alone."""
    items = [i for i in plan.items() if i.ulysses > 1 or i.exchange_kind.collective]
    return _summed(plan, items, shape)[0].collective


def _summed(
    plan: AttentionPlan, items: list[QueueItem], shape: ModelShape
) -> tuple[_Sums, list[dict[str, int]]]:
    """Every rank's sums over `items`, and its tokens per zone: Ulysses-free items on
    arrays, Ulysses ones (a USP group's) position by position."""
    cost = CostModel.create(shape, plan.topology)
    sums = _Sums.zero(plan.world)
    plain = [item for item in items if item.ulysses == 1]
    zones = _add_plain_items(plan, plain, shape, cost, sums) if plain else []
    if len(plain) < len(items):
        part, heads = _head_sums(plan, [item for item in items if item.ulysses > 1], shape, cost)
        sums.add(part)
        zones = _merged(zones, heads) if zones else [dict(z) for z in heads]
    return sums, zones or [{} for _ in range(plan.world)]


def _head_sums(
    plan: AttentionPlan, items: list[QueueItem], shape: ModelShape, cost: CostModel
) -> tuple[_Sums, list[dict[str, int]]]:
    """`_add_items` of the Ulysses `items` into sums of their own, kept on the plan for
    the next caller that sums the same items for the same shape (`plan_stats` and
    `collective_bytes` both do while a step is planned)."""
    key = (shape, tuple(items))
    if key not in plan._head_sums:
        part = _Sums.zero(plan.world)
        plan._head_sums[key] = (part, _add_items(plan, items, shape, cost, part))
    return plan._head_sums[key]


@dataclass(frozen=True)
class _Sums:
    """The per-rank arrays `plan_stats` adds every item to."""

    flops: np.ndarray
    seconds: np.ndarray
    sent: dict[LinkKind, np.ndarray]
    collective: dict[LinkKind, np.ndarray]

    @classmethod
    def zero(cls, world: int) -> _Sums:
        return cls(np.zeros(world), np.zeros(world),
                   {kind: np.zeros(world, dtype=np.int64) for kind in LinkKind},
                   {kind: np.zeros(world, dtype=np.int64) for kind in LinkKind})  # fmt: skip

    def add(self, other: _Sums) -> None:
        """Adds `other`'s sums to these, in place."""
        np.add(self.flops, other.flops, out=self.flops)
        np.add(self.seconds, other.seconds, out=self.seconds)
        for kind in LinkKind:
            self.sent[kind] += other.sent[kind]
            self.collective[kind] += other.collective[kind]


def _merged(zones: list[dict[str, int]], more: list[dict[str, int]]) -> list[dict[str, int]]:
    """Each rank's tokens per zone of both lists, summed."""
    for mine, theirs in zip(zones, more, strict=True):
        for zone, held in theirs.items():
            mine[zone] = mine.get(zone, 0) + held
    return zones


def _add_items(
    plan: AttentionPlan, items: list[QueueItem], shape: ModelShape, cost: CostModel, sums: _Sums
) -> list[dict[str, int]]:
    """Adds each item, members of a ring position at once (any item, Ulysses ones
    included); returns each rank's tokens per zone."""
    zones: list[dict[str, int]] = [{} for _ in range(plan.world)]
    pair_flops = 4.0 * shape.n_heads * shape.head_dim
    for item in items:
        placements = [plan.placement(s) for s in item.seqs]
        held = sum(p.member_token_counts() for p in placements)
        for rank, tokens in zip(item.ranks, held.tolist(), strict=True):
            zones[rank][item.zone.value] = zones[rank].get(item.zone.value, 0) + tokens
        # a position's members share its queries' pairs, each with 1/U of the heads
        pairs = [sum(visible_pairs(a, b) for p in placements for a, b in p.position_ranges(r))
                 for r in range(item.ring_size)]  # fmt: skip
        member_flops = np.repeat(pair_flops * np.asarray(pairs, dtype=np.float64) / item.ulysses,
                                 item.ulysses)  # fmt: skip
        ranks = list(item.ranks)
        sums.flops[ranks] += member_flops
        exchange_bytes = _add_item_bytes(plan, item, held, shape, sums.sent, sums.collective)
        sums.seconds[ranks] += _item_seconds(item, cost, float(member_flops.max()), exchange_bytes)
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
    ring = members.ring[item]
    kv_token = kv_bytes_per_token(shape)
    carried = np.zeros(len(item), dtype=np.int64)
    for exchange, has_it in _kind_masks(kinds):
        carried = np.where(
            has_it[item],
            exchange.carried_tokens(members.rotated, widest[item], ring),
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
    held: np.ndarray,
    shape: ModelShape,
    sent: dict[LinkKind, np.ndarray],
    collective: dict[LinkKind, np.ndarray],
) -> _Exchanged:
    """Adds the bytes every member of `item` sends (`held`: its tokens) around the ring
    and to its Ulysses peers; returns the largest messages."""
    gpus = plan.topology.gpus_per_node
    u_size, ring = item.ulysses, item.ring_size
    position_tokens = np.asarray(plan.position_tokens(item), dtype=np.int64)
    kv_token = (
        kv_bytes_per_token(shape) // u_size
        if u_size <= shape.n_kv_heads
        else (2 * shape.head_dim * BYTES_PER_ELEMENT)
    )
    exchange = item.exchange_kind
    widest = int(position_tokens.max())
    ranks = np.asarray(item.ranks, dtype=np.int64)
    nodes = (ranks // gpus).reshape(ring, u_size)
    links = (LinkKind.INTRA_NODE, LinkKind.INTER_NODE)
    if ring > 1:
        following = np.roll(np.arange(ring), -1)
        crosses = (nodes != nodes[following]).reshape(-1)
        carried = exchange.carried_tokens(plan.carried(item).sent(), widest, ring)
        carried = np.broadcast_to(np.asarray(carried, dtype=np.int64), (ring,))
        carried = np.repeat(carried, u_size) * kv_token
        for link, mine in zip(links, (~crosses, crosses), strict=True):
            sent[link][ranks[mine]] += carried[mine]
            if exchange.collective:
                collective[link][ranks[mine]] += carried[mine]
    busiest = 0
    if u_size > 1:
        per_peer = held * (2 * q_bytes_per_token(shape) + u_size * kv_token) // u_size
        busiest = int(per_peer.max()) * (u_size - 1)
        same = (nodes[:, :, None] == nodes[:, None, :]).sum(axis=2).reshape(-1) - 1
        for link, peers in zip(links, (same, u_size - 1 - same), strict=True):
            sent[link][ranks] += per_peer * peers
            collective[link][ranks] += per_peer * peers
    return _Exchanged(widest * kv_token, busiest)
