"""A large ring played step by step on arrays instead of as tasks.

A ring of R members runs R steps; as a task graph that is R^2 computes and
messages per layer, which at a thousand ranks (te_cp's one global ring) is
millions of tasks. When nothing else uses the ring's links while it runs, its
event schedule obeys a recurrence over steps with one array entry per member:
`ring_forward` and `ring_backward` below are the schedule `ray_zep.sim.program`'s
`ring_forward` / `ring_backward` build for direct (unrouted) hops, each member's
time written from its own and its neighbours' times at the previous step:

- a message from member r to r + 1 at step s starts once both have reached the
  step and r's link to r + 1 is free (each hop has its own link; in backward a
  step's K/V and the previous step's dK/dV queue on it, in that order);
- member r's compute of step s starts at its step point and is slowed while its
  messages of the step move (`ComputeRates.contention`, for the shorter of the
  compute and the messages: the longer of its two directions where the step's exchange
  is one grouped kernel, `ComputeRates.grouped_exchange`, both otherwise);
- forward: r's next point is the latest of its compute and its two K/V messages;
- backward: its dK/dV message of step s leaves once both ends finished step s's
  compute and their previous dK/dV messages, and is in flight during step s + 1;
  the last ones are waited for after the ring. A ring that kept the forward's K/V
  (`kept_ring_backward`) sends no K/V and computes its own block (step 0) last, after
  steps 1 .. R - 1, with no dK/dV message after it: the last ones arrive during it.

The result, every member's time from the ring's start to its end, is exact for
the graph the program would build when the members start the ring together
(tests/test_sim.py checks it against the event simulation).

Shapes: R members (positions), S steps (= R).
"""

from __future__ import annotations

import numpy as np

from ray_zep.costmodel import CostModel
from ray_zep.partition.plan import QueueItem
from ray_zep.topology import LinkKind, Topology

ARRAY_RING = 64
"""Rings of this many members or more are played on arrays where their schedule
allows it (`array_ring`): R^2 tasks per layer would dominate the simulation."""


def array_ring(item: QueueItem, topology: Topology, routed: bool) -> bool:
    """A ring whose schedule `ray_zep.sim.ring_form` plays on arrays: at least
    `ARRAY_RING` members without Ulysses, of an exchange kind that `plays_on_arrays`,
    its hops direct (unrouted, or none crosses nodes) and each on links of its own (no
    two hops share a NIC direction)."""
    if item.ring_size < ARRAY_RING or item.ulysses > 1:
        return False
    if not item.exchange_kind.plays_on_arrays:
        return False
    ring = item.ranks
    links = []
    for src, dst in zip(ring, ring[1:] + ring[:1], strict=True):
        if topology.node_of(src) == topology.node_of(dst):
            links += [("port_out", src), ("port_in", dst)]
        elif routed:
            return False
        else:
            links += [("nic_out", topology.node_of(src), topology.nic_of(src))]
            links += [("nic_in", topology.node_of(dst), topology.nic_of(dst))]
    return len(set(links)) == len(links)


def hop_seconds(
    cost: CostModel, nbytes_RS: np.ndarray, inter_R: np.ndarray, overlapped_RS: np.ndarray
) -> np.ndarray:
    """Seconds of member r's ring message at step s (`CostModel.ring_message_seconds`
    on arrays): `nbytes_RS` bytes over a NIC where `inter_R`, else within the node, in
    flight while its ends compute `overlapped_RS`."""
    across, within = LinkKind.INTER_NODE, LinkKind.INTRA_NODE
    inter = np.asarray(inter_R, dtype=bool)[:, None]
    bandwidth = np.where(
        inter, cost.link_bandwidth(across, True), cost.link_bandwidth(within, True)
    )
    if cost.message_latency:
        computes, latencies = zip(*cost.message_latency, strict=True)
        latency = np.interp(overlapped_RS, computes, latencies)
    else:
        latency = np.where(inter, cost.link_latency(across), cost.link_latency(within))
    return np.where(nbytes_RS > 0, latency + nbytes_RS / bandwidth, 0.0)


def _contended(alone: np.ndarray, moving: np.ndarray, contention: float) -> np.ndarray:
    return alone + (contention - 1.0) * np.minimum(alone, moving)


def _moving(sends: np.ndarray, grouped: bool) -> np.ndarray:
    """Seconds each member's messages of a step slow its compute, `sends` the seconds of
    what member r sends (it receives what r - 1 sends): the longer of the two directions
    where a step's exchange is one grouped kernel, both otherwise
    (`ComputeRates.grouped_exchange`)."""
    receives = np.roll(sends, 1)
    return np.maximum(sends, receives) if grouped else sends + receives


def ring_forward(
    compute_RS: np.ndarray, kv_RS: np.ndarray, contention: float, grouped: bool = False
) -> np.ndarray:
    """Each member's seconds from the ring's start to its last forward step.

    Args:
        compute_RS: member r's compute of step s alone.
        kv_RS: seconds of the K/V message member r sends at step s (to r + 1); the
            last step sends none (its column is ignored).
        contention: `ComputeRates.contention`.
        grouped: `ComputeRates.grouped_exchange`.
    """
    ring, steps = compute_RS.shape
    point = np.zeros(ring)
    for step in range(steps):
        messages, moving = [], 0.0
        if step < steps - 1:
            start = np.maximum(point, np.roll(point, -1))  # both ends posted it
            sent = start + kv_RS[:, step]
            messages = [sent, np.roll(sent, 1)]  # sent to r + 1, received from r - 1
            moving = _moving(kv_RS[:, step], grouped)
        computed = point + _contended(compute_RS[:, step], moving, contention)
        point = np.maximum.reduce([point, computed, *messages])
    return point


def ring_backward(
    compute_RS: np.ndarray,
    kv_RS: np.ndarray,
    dkv_RS: np.ndarray,
    contention: float,
    grouped: bool = False,
) -> np.ndarray:
    """Each member's seconds from the ring's start to its last dK/dV message.

    Args:
        compute_RS: member r's backward compute of step s alone.
        kv_RS: seconds of the K/V message r sends at step s (none at the last step).
        dkv_RS: seconds of the dK/dV message r sends after step s (every step).
        contention: `ComputeRates.contention`.
        grouped: `ComputeRates.grouped_exchange`.
    """
    ring, steps = compute_RS.shape
    point = np.zeros(ring)
    dkv_sent = dkv_received = np.zeros(ring)  # ends of the previous step's dK/dV messages
    dkv_out = np.zeros(ring)  # seconds of the previous step's dK/dV message member r sends
    link = np.zeros(ring)  # when member r's link to r + 1 is free: K/V and dK/dV share it
    for step in range(steps):
        kv_ends = []
        sends = dkv_out.copy()
        if step < steps - 1:
            start = np.maximum.reduce([point, np.roll(point, -1), link])
            sent = link = start + kv_RS[:, step]
            kv_ends = [sent, np.roll(sent, 1)]
            sends += kv_RS[:, step]
        computed = point + _contended(compute_RS[:, step], _moving(sends, grouped), contention)
        ready = np.maximum.reduce([computed, dkv_sent, dkv_received])
        start = np.maximum.reduce([ready, np.roll(ready, -1), link])
        dkv_sent = link = start + dkv_RS[:, step]
        dkv_received = np.roll(dkv_sent, 1)
        dkv_out = dkv_RS[:, step]
        point = np.maximum.reduce([ready, *kv_ends])
    return np.maximum.reduce([point, dkv_sent, dkv_received])


def kept_ring_backward(
    compute_RS: np.ndarray, dkv_RS: np.ndarray, contention: float, grouped: bool = False
) -> np.ndarray:
    """`ring_backward` of a ring that kept the forward's K/V: no K/V messages, steps
    1 .. R - 1 in order, then the member's own block (step 0), during which the
    accumulator of its own K/V comes home (`ExchangeKind.backward_order`); each member's
    seconds from the ring's start until that has arrived and its own has left.

    Args:
        compute_RS: member r's backward compute of step s alone.
        dkv_RS: seconds of the dK/dV message r sends after step s (none after step 0:
            column 0 is not read).
        contention: `ComputeRates.contention`.
        grouped: `ComputeRates.grouped_exchange`.
    """
    ring, steps = compute_RS.shape
    point = np.zeros(ring)
    dkv_sent = dkv_received = dkv_out = np.zeros(ring)
    link = np.zeros(ring)  # when member r's link to r + 1 is free
    for step in [*range(1, steps), 0]:
        moving = _moving(dkv_out, grouped)
        computed = point + _contended(compute_RS[:, step], moving, contention)
        point = np.maximum.reduce([computed, dkv_sent, dkv_received])
        if step == 0:
            break
        start = np.maximum.reduce([point, np.roll(point, -1), link])
        dkv_sent = link = start + dkv_RS[:, step]
        dkv_received = np.roll(dkv_sent, 1)
        dkv_out = dkv_RS[:, step]
    return point
