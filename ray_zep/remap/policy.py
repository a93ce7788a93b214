"""Whether remapping a batch pays off (pure computation).

The remapping layer balances the linear modules, but it also ties every rank to
the slowest attention rank: without it a rank's layer takes its linear work on
its own tokens plus its attention, with it every rank waits for the slowest
attention and then does a balanced share of the linear work. Per layer
(forward + backward) the gain is

    max_r (linear(A_r) + attention_r) - (max_r attention_r + linear(B)),

linear at the matmul rate for the block's FLOPs per token, attention from the
partitioner's first-order model (`partition.stats`), backward scaled by its
FLOP factor and rate. It costs four
all-to-all-v per layer (q/k/v in and the output out, forward; their gradients,
backward). Each is estimated as its busiest rank's time: a rank's ports send
and receive at once, so the larger of the two counts, with every token priced
at the intra-node or the shared-NIC rate (`remap.solver.token_costs`), plus
one latency: a rank posts its messages as one batch, whose latencies overlap (the
longest counts; `ray_zep.sim.events`). The solver's own objective counts only senders
(Zeppelin eq. 2); the receive side matters here because a rank that holds no
attention tokens receives its whole linear layout.

A remap also costs the overlap of USP head exchanges: with `parallel.ulysses_chunks`
pieces a USP member exchanges its rows beside its Q/K/V and output projections, but
where a remap moves rows the engine runs each exchange whole, between the linear
modules (`ray_zep.train.runners.EngineAttention`, as the simulator plays it). That adds
what the pieces hid on the USP member that loses most (`lost_overlap_seconds`). On
`bench scale`'s 7b chat batch at 64 GPUs (one group of 64 ranks holding the 146k-token
document) the remap's exchanges were estimated at 2.3 ms a layer against 5.0 ms saved,
and the remapped step played 2.5% slower; the pieces hide 4.6 ms a layer of that group's
exchanges, and with them counted the batch is not remapped.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ray_zep.config import RemapPolicy
from ray_zep.costmodel import (
    BACKWARD_ATTENTION_FACTOR,
    BACKWARD_LINEAR_FACTOR,
    ComputeRates,
    linear_flops_per_token,
    q_bytes_per_token,
)
from ray_zep.model_shapes import ModelShape
from ray_zep.partition.plan import AttentionPlan
from ray_zep.partition.stats import attention_seconds
from ray_zep.partition.work import WorkModel
from ray_zep.remap.solver import RemapPlan, remap_token_bytes, solve_remap, token_costs
from ray_zep.topology import Topology


def remap_gain_seconds(
    remap: RemapPlan, attention_seconds: np.ndarray, shape: ModelShape, rates: ComputeRates
) -> float:
    """Seconds one layer (forward + backward) saves by remapping (module docstring).

    Args:
        attention_seconds: modelled forward attention seconds per rank.
    """
    per_token = sum(linear_flops_per_token(shape)) * (1 + BACKWARD_LINEAR_FACTOR) / rates.matmul
    backward = BACKWARD_ATTENTION_FACTOR * rates.attention_forward / rates.attention_backward
    attention = np.asarray(attention_seconds) * (1 + backward)
    before = np.asarray(remap.counts_before) * per_token + attention
    after = max(remap.counts_after, default=0) * per_token + attention.max(initial=0.0)
    return float(before.max(initial=0.0) - after)


def remap_cost_seconds(remap: RemapPlan, topology: Topology, shape: ModelShape) -> float:
    """Estimated transfer seconds of one layer's four remap exchanges."""
    total = 0.0
    for token_bytes in (remap_token_bytes(shape), q_bytes_per_token(shape)):
        total += 2 * _exchange_seconds(remap, topology, token_bytes)
    return total


def _exchange_seconds(remap: RemapPlan, topology: Topology, token_bytes: int) -> float:
    if not remap.transfers:
        return 0.0
    intra, inter = token_costs(topology, token_bytes)
    src, dst, tokens = np.asarray(remap.transfers, dtype=np.int64).T
    same = src // topology.gpus_per_node == dst // topology.gpus_per_node
    latency = np.where(same, topology.intra_node_latency, topology.inter_node_latency)
    seconds = tokens * np.where(same, intra, inter)
    sent, received = np.zeros(topology.world_size), np.zeros(topology.world_size)
    np.add.at(sent, src, seconds)
    np.add.at(received, dst, seconds)
    waited = np.zeros(topology.world_size)  # each rank's batch: its longest latency
    np.maximum.at(waited, src, latency)
    np.maximum.at(waited, dst, latency)
    return float((np.maximum(sent, received) + waited).max())


def choose_remap(
    plan: AttentionPlan,
    shape: ModelShape,
    rates: ComputeRates,
    policy: RemapPolicy,
    ulysses_pieces: int = 1,
) -> RemapPlan | None:
    """The remap plan of `plan`'s batch, or None when nothing moves or `policy` is
    when_faster and the estimate says remapping would not save time (`ulysses_pieces`:
    the pieces USP head exchanges run in without a remap, `ParallelConfig.ulysses_pieces`)."""
    topology = plan.topology
    remap = solve_remap(plan.rank_tokens(), topology, remap_token_bytes(shape))
    if not remap.transfers:
        return None
    if policy is RemapPolicy.ALWAYS:
        return remap
    attention = attention_seconds(plan, shape)
    gain = remap_gain_seconds(remap, attention, shape, rates)
    cost = remap_cost_seconds(remap, topology, shape)
    if gain <= cost:
        return None
    cost += lost_overlap_seconds(plan, shape, rates, ulysses_pieces)
    return remap if gain > cost else None


def lost_overlap_seconds(
    plan: AttentionPlan, shape: ModelShape, rates: ComputeRates, ulysses_pieces: int
) -> float:
    """Seconds of one layer (forward + backward) that a remap exposes on the USP member
    that loses most: its head exchanges run whole rather than in `ulysses_pieces` beside
    the projections (module docstring); 0 where there are no USP items or one piece."""
    items = [item for item in plan.items() if item.ulysses > 1]
    if ulysses_pieces <= 1 or not items:
        return 0.0
    tokens = np.asarray([sum(plan.position_tokens(item)) for item in items])
    u = np.asarray([item.ulysses for item in items])
    positions = np.asarray([item.ring_size for item in items])
    pieces = WorkModel.create(shape, plan.topology, rates, ulysses_pieces=ulysses_pieces)
    whole = dataclasses.replace(pieces, ulysses_pieces=1)
    lost = sum(whole.usp_exchange_seconds(tokens, positions, u)) - sum(
        pieces.usp_exchange_seconds(tokens, positions, u)
    )
    return float(lost.max())
