"""`usp_guests`' loop, compiled (`ray_zep.partition.compiled`): split sequences join USP
groups of whole-node positions (the hosts) as guests, `CHUNK` at a time, in rounds (module
docstring of `ray_zep.partition.usp_guests`), each host costed by `host_costs`:
`WorkModel.usp_group_costs` at U = G, the same arithmetic in the same order, one group at
a time, on the model's numbers `costs_of` gathers.

Shapes: H hosts, O = GROWTH + 1 offsets (the nodes a host may add), P = 5 parts a host's
sequences sum to at each offset (`_PARTS`).
"""

from __future__ import annotations

import numpy as np

from ray_zep.costmodel import BACKWARD_ATTENTION_FACTOR, BACKWARD_LINEAR_FACTOR, kv_bytes_per_token
from ray_zep.partition.compiled import compiled, compiled_inline
from ray_zep.partition.work import FORWARD_SHARE, KV_DTYPE_DKV_FACTOR, WorkModel, ulysses_row_bytes
from ray_zep.topology import LinkKind

GROWTH = 1
"""Whole nodes a host may add for its guests (each time fewer ranks than the guest's own
group takes)."""
CHUNK = 64
"""Guests weighed against every host at once: the later ones only once the earlier have
joined or fit nowhere, by when the hosts have less room."""
_PARTS = 5
"""A host's sums at each offset: its ring parts (diagonal, step, send), its tokens, and the
most tokens a member holds (each sequence's share rounded up)."""


(U, U_LESS_ONE, ROW, FORWARD_ROW, INTRA_LATENCY, INTRA_BANDWIDTH, INTER_LATENCY,
 INTER_BANDWIDTH, LINEAR_PER_TOKEN, LAYERS, KV_PER_TOKEN, DKV_FACTOR, KEEP_BYTES,
 ROOM_PER_TOKEN, CAPACITY, KEPT_PER_TOKEN, BACKWARD_ATTENTION, BACKWARD_LINEAR, FORWARD,
 PROJECTIONS_PER_TOKEN, HIDDEN, COUNT) = range(22)  # fmt: skip
"""Where each number sits in `costs_of`'s array."""


def costs_of(model: WorkModel) -> np.ndarray:
    """The numbers `host_costs` reads, for groups of U = G (every GPU of a node), and
    `FORWARD_SHARE` (as numbers, not module constants: numba's cache checks this file
    alone)."""
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
    values[BACKWARD_ATTENTION] = BACKWARD_ATTENTION_FACTOR
    values[BACKWARD_LINEAR] = BACKWARD_LINEAR_FACTOR
    values[FORWARD] = FORWARD_SHARE
    values[PROJECTIONS_PER_TOKEN] = model._projections_per_token_s
    values[HIDDEN] = 1.0 - 1.0 / model.ulysses_pieces  # `exposed_exchange`'s
    return values


@compiled_inline
def host_costs(
    diagonal: float, step: float, send: float, tokens: float, positions: float, k: np.ndarray
) -> tuple[float, float]:
    """(`usp_group_seconds`, `usp_group_forward_seconds`) of one group of U = G at
    `positions` whose sequences' ring parts sum to `diagonal`, `step` and `send` and
    whose tokens to `tokens` (`k`: `costs_of`'s numbers)."""
    u, latency = k[U], k[INTRA_LATENCY]
    # the all-to-alls: a position of one whole node moves (U - 1) / U of its rows inside it
    member = tokens / (positions * u)
    moved = member * k[U_LESS_ONE] / u * k[ROW] / k[INTRA_BANDWIDTH]
    moved = max(moved, 0.0)
    forward = 2 * latency + moved * k[FORWARD_ROW] / k[ROW]
    backward = 4 * latency + moved - forward
    projections = member * k[PROJECTIONS_PER_TOKEN]  # `exposed_exchange`
    forward = forward - min(forward, projections) * k[HIDDEN]
    backward = backward - min(backward, projections * k[BACKWARD_LINEAR]) * k[HIDDEN]
    diagonal, step, send = diagonal / u, step / u, send / u  # a member's heads
    share = 1.0 / (1.0 + k[BACKWARD_ATTENTION])
    hop = k[INTER_LATENCY] + send / k[INTER_BANDWIDTH]
    ring = diagonal * share + (positions - 1) * max(step * share, hop)
    linear = member * k[LINEAR_PER_TOKEN]
    forward_s = linear / (1.0 + k[BACKWARD_LINEAR]) + k[LAYERS] * (forward + ring)
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


@compiled
def guest_kernel(
    row: np.ndarray,
    lengths: np.ndarray,
    work: np.ndarray,
    values: np.ndarray,
    ready: np.ndarray,
    hosts: np.ndarray,
    base: np.ndarray,
    guests: np.ndarray,
    degrees: np.ndarray,
    seconds: np.ndarray,
    host_of: np.ndarray,
    level: float,
    capacity: int,
    gpus: int,
    nodes: int,
    k: np.ndarray,
) -> int:
    """Joins `guests` (in order) to `hosts` (indices into the split sequences, like them),
    writing `host_of`, `degrees` and `seconds` (each host's as its guests make them).
    `row`: each split sequence's row of `values` (its ring parts at each count of
    positions, where `ready`); `lengths`, `work`: its tokens and whole work; `base`: each
    host's positions; `k`: `costs_of`'s numbers.

    Returns 0, or a count of positions not `ready` that a host grew to: then nothing is
    decided, and the caller readies it and calls again."""
    count, offsets = hosts.size, GROWTH + 1
    for h in range(count):
        for o in range(offsets):
            if not ready[_positions(base, h, o, nodes)]:
                return _positions(base, h, o, nodes)
    held = np.empty((count, guests.size + 1), dtype=np.int64)  # each host's sequences
    held_n = np.ones(count, dtype=np.int64)
    sums = np.empty((_PARTS, count, offsets))
    for h in range(count):
        held[h, 0] = hosts[h]
        _count(sums, held, held_n, h, base, row, lengths, values, gpus, nodes)
    fits = np.zeros((CHUNK, count, offsets), dtype=np.bool_)
    cost = np.zeros((CHUNK, count, offsets))
    chunk = np.empty(CHUNK, dtype=np.int64)
    alone = np.empty((2, count, offsets))  # each host's member work and forward as it stands
    for start in range(0, guests.size, CHUNK):
        for h in range(count):
            for o in range(offsets):
                alone[0, h, o], alone[1, h, o] = host_costs(
                    sums[0, h, o], sums[1, h, o], sums[2, h, o], sums[3, h, o],
                    float(_positions(base, h, o, nodes)), k,
                )  # fmt: skip
        size = 0
        for guest in guests[start : start + CHUNK]:
            if _may_fit(sums, alone, base, guest, lengths, work, degrees[guest], level, capacity,
                        gpus, nodes, k):  # fmt: skip
                chunk[size] = guest
                size += 1
        alive = np.zeros(size, dtype=np.bool_)
        every = np.ones(count, dtype=np.bool_)
        for r in range(size):
            _evaluate(fits, cost, r, every, sums, base, chunk[r], row, lengths, values,
                      degrees[chunk[r]], level, capacity, gpus, nodes, k)  # fmt: skip
            alive[r] = fits[r].any()
        while alive.any():
            # in rounds: each guest in turn joins the host it chooses unless another
            # joined that host this round (it then chooses again, on the host as it is)
            touched = np.zeros(count, dtype=np.bool_)
            waiting = np.zeros(size, dtype=np.bool_)
            for r in range(size):
                if not alive[r]:
                    continue
                h, offset = _choice(fits[r], cost[r])
                if touched[h]:
                    waiting[r] = True
                    continue
                touched[h] = True
                guest = chunk[r]
                if offset:
                    base[h] += offset
                    for o in range(offsets):
                        if not ready[_positions(base, h, o, nodes)]:
                            return _positions(base, h, o, nodes)
                held[h, held_n[h]] = guest
                held_n[h] += 1
                if offset:
                    _count(sums, held, held_n, h, base, row, lengths, values, gpus, nodes)
                else:
                    for o in range(offsets):
                        _add(sums, h, o, guest, _positions(base, h, o, nodes), row, lengths,
                             values, gpus)  # fmt: skip
                host_of[guest] = hosts[h]
                seconds[hosts[h]] = cost[r, h, offset]
                degrees[hosts[h]] = base[h] * gpus
            for r in range(size):
                alive[r] = False
                if not waiting[r]:
                    continue
                _evaluate(fits, cost, r, touched, sums, base, chunk[r], row, lengths, values,
                          degrees[chunk[r]], level, capacity, gpus, nodes, k)  # fmt: skip
                alive[r] = fits[r].any()
    return 0


@compiled_inline
def _positions(base, h, offset, nodes) -> int:
    """Host `h`'s positions plus `offset` (at most the cluster's nodes: an offset past them
    reads the host's own count, and `_evaluate` refuses it)."""
    positions = base[h] + offset
    return positions if positions <= nodes else base[h]


@compiled_inline
def _shares(seq, positions, row, lengths, values, gpus) -> tuple:
    """What a sequence adds to a group at `positions`: its ring parts, tokens and share
    of a member's tokens rounded up."""
    at = row[seq]
    tokens = lengths[seq]
    return (values[0, at, positions], values[1, at, positions], values[2, at, positions],
            tokens, np.ceil(tokens / (positions * gpus)))  # fmt: skip


@compiled
def _add(sums, h, o, seq, positions, row, lengths, values, gpus) -> None:
    parts = _shares(seq, positions, row, lengths, values, gpus)
    for p in range(_PARTS):
        sums[p, h, o] += parts[p]


@compiled
def _count(sums, held, held_n, h, base, row, lengths, values, gpus, nodes) -> None:
    """Host `h`'s sums over its sequences, in the order they joined."""
    for o in range(GROWTH + 1):
        positions = _positions(base, h, o, nodes)
        parts = _shares(held[h, 0], positions, row, lengths, values, gpus)
        for p in range(_PARTS):
            sums[p, h, o] = parts[p]
        for i in range(1, held_n[h]):
            _add(sums, h, o, held[h, i], positions, row, lengths, values, gpus)


@compiled
def _may_fit(sums, alone, base, guest, lengths, work, own, level, capacity, gpus, nodes,
             k) -> bool:  # fmt: skip
    """A quick test of the guest fitting some host as the hosts stand: each host's member
    work alone at each offset (`alone`) plus the guest's whole work spread over the
    host's GPUs (what it adds at least), and the forward alone plus the linear modules'
    forward of its share of tokens, within the level, and the members' tokens within L."""
    for h in range(sums.shape[1]):
        for o in range(GROWTH + 1):
            if not o * gpus < own:
                continue
            members = _positions(base, h, o, nodes) * gpus
            share = lengths[guest] / members
            spread = work[guest] / members
            if (alone[0, h, o] + spread <= level and sums[4, h, o] + np.ceil(share) <= capacity
                    and alone[1, h, o] + share * k[LINEAR_PER_TOKEN] * k[FORWARD]
                    <= level * k[FORWARD]):  # fmt: skip
                return True
    return False


@compiled
def _evaluate(fits, cost, r, which, sums, base, guest, row, lengths, values, own, level,
              capacity, gpus, nodes, k) -> None:  # fmt: skip
    """Whether the guest fits each host `which` marks at each offset as it stands (its
    members' tokens within L, fewer ranks than its own group, no more nodes than exist,
    the member work and forward within the level), and where its tokens fit the host's
    member work then. Every host is costed, fitting or not, with no branch around the
    costing, so that the loop over hosts compiles to vector code; the answers are those
    of costing only the hosts that fit."""
    for h in range(base.size):
        for o in range(GROWTH + 1):
            positions = _positions(base, h, o, nodes)
            parts = _shares(guest, positions, row, lengths, values, gpus)
            room = ((sums[4, h, o] + parts[4] <= capacity) & (o * gpus < own)
                    & (base[h] + o <= nodes))  # fmt: skip
            seconds, forward = host_costs(sums[0, h, o] + parts[0], sums[1, h, o] + parts[1],
                                          sums[2, h, o] + parts[2], sums[3, h, o] + parts[3],
                                          float(positions), k)  # fmt: skip
            fits_now = room & (seconds <= level) & (forward <= level * k[FORWARD])
            if which[h]:
                if room:  # its member work is read where it fits alone
                    cost[r, h, o] = seconds
                fits[r, h, o] = fits_now


@compiled
def _choice(fits, cost) -> tuple[int, int]:
    """The host a guest joins (hosts x offsets) and at which offset: of the hosts it fits,
    those it adds the fewest nodes to, and of those the one it leaves the least work room
    in (the first on ties)."""
    count, offsets = fits.shape
    least = offsets
    for h in range(count):
        for o in range(offsets):
            if fits[h, o]:
                least = min(least, o)
                break
    best, chosen = -np.inf, 0
    for h in range(count):
        first = offsets
        for o in range(offsets):
            if fits[h, o]:
                first = o
                break
        if first == least and cost[h, first] > best:
            best, chosen = cost[h, first], h
    return chosen, least
