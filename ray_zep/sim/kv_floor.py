"""A floor under a plan's simulated step from the ring bytes its nodes must send, its
gathered rings' collectives and its busiest rank's compute, worked out from the plan alone
(no layer graph): `plan --auto` skips playing a composition whose floor is above steps it
has already played (`ray_zep.sim.auto`).

A rotating ring (`Play.ROTATE`) passes each position's K/V block to the next position
R - 1 times in every layer's forward, so the hop from position p to p + 1 carries every
block but p + 1's own; the backward passes them again unless the ring kept them
(`ExchangeKind.keeps_kv`), and passes the dK/dV accumulators R times, every block (R - 1
times, all but its own, where it kept them: `ExchangeKind.backward_order`;
`ray_zep.sim.ring_form`: the same rows, in the dK/dV wire's dtype; items that send their
dK/dV straight to the owners, `parallel.dkv_wire=owner`, are left out of that part).
Under Ulysses each of the U members of a position carries its share of the K/V heads.
Where a hop crosses nodes those bytes leave the sending node: direct, through the sender's
own NIC; routed, through the NICs of the node's proxies (a routed transfer crosses between
the two nodes once). A NIC sends at most `nic_bandwidth` bytes a second, so each phase of
every layer lasts at least the busiest NIC's bytes (direct hops) or the busiest node's over
all its NICs (routed) over that; zipped (`comm.compression` on any stream) the bytes shrink
by at most ZipCCL's best ratio. A gathered item (`Play.GATHER`, LLaMA-3 style) all-gathers
its K/V over its members before the forward's attention and reduce-scatters the dK/dV after
the backward's, and the phase's layer lasts at least the longest of those collectives (the
cost model's seconds, as the layer graph prices them). Everything else a step does
(compute, latencies, the weights' collectives) only adds to it. Nor can a phase end before
the busiest rank has computed its attention and linear modules (`busiest_compute`), so each
phase's floor is the longest of the three, and the floor is below the simulated step of any
composition of the autograd family (`tests/test_kv_floor.py` checks it against the
simulator).

Shapes: R ring positions, U members per position.
"""

from __future__ import annotations

import numpy as np

from ray_zep.costmodel import (
    BACKWARD_ATTENTION_FACTOR,
    BACKWARD_LINEAR_FACTOR,
    linear_flops_per_token,
    pointwise_elements_per_token,
)
from ray_zep.partition.exchange import Play
from ray_zep.partition.plan import AttentionPlan
from ray_zep.partition.stats import PlanStats
from ray_zep.sim.layer_work import POINTWISE_SHARES, linear_part_seconds
from ray_zep.sim.step import RunModel
from ray_zep.sim.wire import ZIP_RATIOS


def kv_floor_seconds(
    plan: AttentionPlan, run: RunModel, routed: bool, compute: np.ndarray | None = None
) -> float:
    """The least seconds a step of `plan` under `run` lasts for what its plan alone decides
    (module docstring): in each phase of every layer the longest of the ring K/V and dK/dV
    its busiest NIC or node sends (none where no ring crosses nodes), its longest gathered
    collective and `compute`.

    Args:
        plan: the batch's attention plan.
        run: the run (model, the wire's element and dK/dV bytes, the codec).
        routed: inter-node ring hops go through proxies (`parallel.routing`).
        compute: the busiest rank's compute in a layer's forward and backward
            (`busiest_compute`), each phase's floor where higher.
    """
    topology = plan.topology
    if compute is None:
        compute = np.zeros(2)
    if topology.nodes < 2 or not topology.nic_bandwidth > 0:
        return run.shape.n_layers * float(compute.sum())
    shape, gpus = run.shape, topology.gpus_per_node
    lanes = 1 if routed else topology.nics_per_node  # what a node's bytes are counted on
    sent = np.zeros((2, topology.nodes, lanes))  # forward, backward
    nic = np.asarray([topology.nic_of(r) for r in range(gpus)], dtype=np.int64)
    gathered = np.zeros(2)  # the longest gather (forward) and reduce-scatter (backward)
    for item in plan.items():
        ring = item.ring_size
        play = item.exchange_kind.play_for(ring) if ring >= 2 else None
        if play not in (Play.ROTATE, Play.GATHER):
            continue
        u = item.ulysses
        heads = shape.n_kv_heads // u if u <= shape.n_kv_heads else 1
        values = 2 * heads * shape.head_dim  # K and V of one row, per member
        rows = np.asarray(plan.position_tokens(item), dtype=np.float64)
        if play is Play.GATHER:
            gathered = np.maximum(gathered, _gather_seconds(item, rows.max() * values, run))
            continue
        # hop p -> p + 1: every block but p + 1's, each trimmed (`AttentionPlan.carried`)
        others = plan.carried(item).sent().astype(np.float64)
        forward = others * values * run.element_bytes
        kept = item.exchange_kind.keeps_kv
        backward = np.zeros(ring) if kept else forward
        if not (run.dkv_owner and item.owner_dkv):  # a kept ring's own block sends none
            backward = backward + (rows.sum() - rows * kept) * values * run.dkv_bytes
        ranks = np.asarray(item.ranks, dtype=np.int64).reshape(ring, u)
        nodes = ranks // gpus
        across = nodes != np.roll(nodes, -1, axis=0)
        lane = np.zeros_like(ranks) if routed else nic[ranks % gpus]
        for phase, carried in enumerate((forward, backward)):
            per_member = np.broadcast_to(carried[:, None], ranks.shape)
            np.add.at(sent[phase], (nodes[across], lane[across]), per_member[across])
    capacity = topology.nic_bandwidth * (topology.nics_per_node if routed else 1)
    zipped = any(run.codec().zips(stream) for stream in run.config.comm.compression_streams)
    ratio = max(ZIP_RATIOS.values()) if zipped else 1.0
    busiest = sent.reshape(2, -1).max(axis=1) / ratio / capacity
    return shape.n_layers * float(np.maximum.reduce([busiest, gathered, compute]).sum())


def busiest_compute(stats: PlanStats, run: RunModel, remapped: bool) -> np.ndarray:
    """The least compute of the busiest rank in a layer's forward and in its backward
    (seconds): its attention FLOPs (`PlanStats.attention_flops`, the pairs its queries
    see, over U under Ulysses) at the fastest rate any attention kernel reaches, and its
    linear modules over its tokens at their rates (left out where the remap moves the
    tokens the linear modules run on). A rank computes one task at a time, so a phase of
    a layer lasts at least that long; the weights' collectives, recomputation, kernel
    call costs and lower rates only add to it. On a CPU virtual cluster (`CorePool`) a
    rank computing alone runs faster than its tasks' stated times, by at most 1 / share."""
    rates, shape = run.hardware.rates, run.shape
    tokens = np.zeros(len(stats.tokens)) if remapped else stats.tokens.astype(np.float64)
    elements = pointwise_elements_per_token(shape)
    factors = ((1.0, 1.0), (BACKWARD_LINEAR_FACTOR, BACKWARD_ATTENTION_FACTOR))
    out = []
    for phase, (factor, attention) in enumerate(factors):
        parts = zip(linear_flops_per_token(shape), POINTWISE_SHARES[phase], strict=True)
        linear = sum(linear_part_seconds(1.0, flops, share * elements, rates, factor)
                     for flops, share in parts)  # fmt: skip
        fastest = _fastest_attention(rates, backward=phase == 1)
        seconds = tokens * linear + attention * stats.attention_flops / fastest
        out.append(float(seconds.max(initial=0.0)))
    pool = run.hardware.pool  # a CPU virtual cluster: a rank alone may take a whole core
    return np.asarray(out) * (pool.share if pool is not None else 1.0)


def _fastest_attention(rates, backward: bool) -> float:
    """The highest FLOP/s any attention block reaches, causal or not, in the engine or
    under autograd: the top of a measured curve (flat past its ends), else the half-rate
    form's limit."""
    best = 0.0
    for causal, autograd in ((True, False), (True, True), (False, False), (False, True)):
        curve, _ = rates.rate_curve(causal, backward, autograd)
        if curve is not None:
            best = max(best, max(rate for _, rate in curve))
        else:
            best = max(best, rates.attention_backward if backward else rates.attention_forward)
    return best


def _gather_seconds(item, values: float, run: RunModel) -> np.ndarray:
    """A gathered item's K/V all-gather and dK/dV reduce-scatter (seconds), `values` the
    K and V elements of its fullest position, as the layer graph prices them
    (`ray_zep.sim.program`: the K/V in the activation dtype, the dK/dV in the dK/dV wire's
    unless the item sends them to their owners)."""
    cost = run.hardware.cost(run.shape)
    owned = run.dkv_owner and item.owner_dkv
    dkv = run.element_bytes if owned else run.dkv_bytes
    return np.asarray([cost.all_gather_seconds(values * size, item.ranks)
                       for size in (run.element_bytes, dkv)])  # fmt: skip
