"""A USP group of whole-node positions costed one group at a time, compiled
(`ray_zep.partition.compiled`): `WorkModel.usp_group_costs` at U = G, the same arithmetic
in the same order, for `usp_guests`' kernel, which weighs each guest against each host.

`HostCosts.of(model)` gathers the model's numbers the formula reads (hops, row bytes, the
K/V budget) into one array; `host_costs` plays the formula on one group's summed ring
parts (`RingParts`), its tokens and its positions.
"""

from __future__ import annotations

import numpy as np

from ray_zep.costmodel import BACKWARD_ATTENTION_FACTOR, BACKWARD_LINEAR_FACTOR, kv_bytes_per_token
from ray_zep.partition.compiled import compiled
from ray_zep.partition.work import KV_DTYPE_DKV_FACTOR, WorkModel, ulysses_row_bytes
from ray_zep.topology import LinkKind

(U, U_LESS_ONE, ROW, FORWARD_ROW, INTRA_LATENCY, INTRA_BANDWIDTH, INTER_LATENCY,
 INTER_BANDWIDTH, LINEAR_PER_TOKEN, LAYERS, KV_PER_TOKEN, DKV_FACTOR, KEEP_BYTES,
 ROOM_PER_TOKEN, CAPACITY, KEPT_PER_TOKEN, COUNT) = range(17)  # fmt: skip
"""Where each number sits in `of`'s array."""


def of(model: WorkModel) -> np.ndarray:
    """The numbers `host_costs` reads, for groups of U = G (every GPU of a node)."""
    gpus = model.cost.topology.gpus_per_node
    u = np.asarray(gpus).astype(np.float64)  # as `WorkModel._usp_group` makes it
    values = np.zeros(COUNT)
    values[U] = u
    values[U_LESS_ONE] = np.minimum(u, gpus) - 1
    values[ROW] = ulysses_row_bytes(model.shape, u)
    values[FORWARD_ROW] = ulysses_row_bytes(model.shape, u, forward=True)
    values[INTRA_LATENCY], values[INTRA_BANDWIDTH] = model.hop(LinkKind.INTRA_NODE)
    values[INTER_LATENCY] = model.cost.link_latency(LinkKind.INTER_NODE)
    values[INTER_BANDWIDTH] = model.cost.link_bandwidth(LinkKind.INTER_NODE)
    values[LINEAR_PER_TOKEN] = model._linear_per_token_s
    values[LAYERS] = model.layers
    values[KV_PER_TOKEN] = kv_bytes_per_token(model.shape)
    values[DKV_FACTOR] = KV_DTYPE_DKV_FACTOR if model.owner_dkv else model.dkv_factor
    values[KEEP_BYTES] = model.keep_kv_bytes
    values[ROOM_PER_TOKEN] = model.room_per_token
    values[CAPACITY] = model.capacity
    values[KEPT_PER_TOKEN] = kv_bytes_per_token(model.shape) * model.layers
    return values


@compiled
def host_costs(
    diagonal: float, step: float, send: float, tokens: float, positions: float, k: np.ndarray
) -> tuple[float, float]:
    """(`usp_group_seconds`, `usp_group_forward_seconds`) of one group of U = G at
    `positions` whose sequences' ring parts sum to `diagonal`, `step` and `send` and
    whose tokens to `tokens` (`k`: `of`'s numbers)."""
    u, latency = k[U], k[INTRA_LATENCY]
    # the all-to-alls: a position of one whole node moves (U - 1) / U of its rows inside it
    member = tokens / (positions * u)
    moved = member * k[U_LESS_ONE] / u * k[ROW] / k[INTRA_BANDWIDTH]
    moved = max(moved, 0.0)
    forward = 2 * latency + moved * k[FORWARD_ROW] / k[ROW]
    backward = 4 * latency + moved - forward
    diagonal, step, send = diagonal / u, step / u, send / u  # a member's heads
    share = 1.0 / (1.0 + BACKWARD_ATTENTION_FACTOR)
    hop = k[INTER_LATENCY] + send / k[INTER_BANDWIDTH]
    ring = diagonal * share + (positions - 1) * max(step * share, hop)
    linear = member * k[LINEAR_PER_TOKEN]
    forward_s = linear / (1.0 + BACKWARD_LINEAR_FACTOR) + k[LAYERS] * (forward + ring)
    # the ring, forward and backward (`WorkModel._ring_seconds`)
    steps = positions - 1
    held = send / k[KV_PER_TOKEN]
    budget = k[KEEP_BYTES]
    if k[ROOM_PER_TOKEN] > 0:
        budget = budget + max(0.0, k[CAPACITY] - held) * k[ROOM_PER_TOKEN]
    keeps = steps * held * k[KEPT_PER_TOKEN] / 1 <= budget
    again = k[DKV_FACTOR] - (1.0 if keeps else 0.0)
    send_f = k[INTER_LATENCY] + send / k[INTER_BANDWIDTH]
    send_b = k[INTER_LATENCY] + again * send / k[INTER_BANDWIDTH]
    step_f, step_b = step * share, step * (1 - share)
    ring = diagonal + steps * (max(step_f, send_f) + max(step_b, send_b))
    return linear + k[LAYERS] * (forward + backward + ring), forward_s
