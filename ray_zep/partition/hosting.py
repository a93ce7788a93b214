"""Rings inside a node that ride on the whole nodes of a ring across nodes
(`ray_zep.partition.balance`).

A sequence longer than L tokens needs a ring whatever its work. Where its tokens are
sparse in work (a 30k-token document at 16k tokens per GPU: two or three ranks for its
tokens, each then well under the level), those ranks hold L tokens and little work,
while the members of a ring across nodes over a dense document reach the level holding
half of L. The whole sequences cannot even this out: they need token room, and the
sparse ring's members have none.

So a ring inside a node (one sequence, or several sharing it) may become a guest: its
sequences run as one more ring over all G GPUs of one whole node of a host, a ring or
USP group across nodes not at its floor, each member holding 1/G of each guest's
tokens. The engine runs a rank's items across nodes before those inside a node, so every
member of the guest ring has ended the host's ring (together: a ring steps in lock-step)
when the guest's starts; the guest's own ranks are freed. A plain ring host may take
more ranks than the level needs so that its members have work and token room for
guests: of a few widenings, the one that frees the most ranks (the guests' own ranks
less the ones added) wins, and none where none frees any. The freed ranks take the
whole sequences the level's fill had no room for. Only a level whose rings fit the world
on their own is hosted: crediting what hosting might free at the levels below (an
upper bound on it) made `plan_step` at 1,024 GPUs 18-47% slower (7b chat and arxiv) and
moved three rows of `bench scale`'s grid: 13b arxiv at 256 GPUs 3.7% faster, 7b arxiv
at 256 GPUs 1.7% and 13b arxiv at 1,024 GPUs 0.4% slower.

A guest's member work is its sequences' rings of G members alone, summed (an upper
bound of the shared ring's, as `ring_groups` counts one; `small_ring_seconds` has costed
them for every level). A guest ring sends its K/V again in the backward, since its
host's keeping already counts on the ranks' K/V budget (`Placed.resent`), unless the
memory pass `keep_where_room` finds the room; its cost counts them kept where the
budget alone would hold them, as for any ring inside a node. Guests are offered most wasted
rank-seconds first (their ranks at the level less their work), each to the first whole
node of the host with the work and token room for it (first fit), the host's own
kept K/V room (`WorkModel.reserved_tokens`) set aside first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_zep.partition.ring_groups import RingGroup
from ray_zep.partition.work import WorkModel

WIDENINGS = 6
"""Widenings tried per plain-ring host besides none, in even steps up to half its degree
(at least one rank each). On `bench scale`'s grid 4 steps lost where 6 gained (7b and
13b github at 256 GPUs, 16k tokens per GPU: 17.101 and 30.252 s against 16.674 and
28.431 s; 17.346 and 28.995 s with no hosting)."""


@dataclass(frozen=True)
class Hosting:
    """A level's rings with guests on hosts' whole nodes.

    Attributes:
        rings: the level's rings, hosts' degrees and member work as widened.
        guests: host ring index -> for each of its whole nodes in rank order, the guest
            ring indices it takes (possibly none).
        guest_seconds: guest ring index -> member work of its sequences over G GPUs.
    """

    rings: list[RingGroup]
    guests: dict[int, list[list[int]]]
    guest_seconds: dict[int, float]

    def guest_rings(self) -> set[int]:
        return {g for nodes in self.guests.values() for node in nodes for g in node}


def host_rings(
    rings: list[RingGroup],
    lengths: np.ndarray,
    node_ring: np.ndarray,
    usp: np.ndarray,
    floor: np.ndarray,
    level: float,
    capacity: int,
    gpus: int,
    model: WorkModel,
) -> Hosting | None:
    """Guests for the hosts among `rings` (module docstring); None where none frees ranks.

    Args:
        rings: the level's rings; their members index `lengths`, `usp` and `floor`.
        lengths: tokens of each split sequence.
        node_ring: member work of each one's ring over a node's G GPUs.
        usp: U of each one's USP group, 0 for a ring.
        floor: those no degree brings under the level.
        level: the most work a rank may carry.
        capacity: L.
        gpus: G, GPUs per node.
        model: the work model.
    """
    pool = [k for k, r in enumerate(rings) if r.degree <= gpus and r.member_seconds < level]
    hosts = [
        k
        for k, r in enumerate(rings)
        if r.degree > gpus
        and len(r.members) == 1
        and not floor[r.members[0]]
        and usp[r.members[0]] in (0, gpus)
    ]
    if not pool or not hosts:
        return None
    seconds, tokens = _spread(rings, pool, lengths, node_ring, gpus)
    degrees = np.asarray([rings[k].degree for k in pool], dtype=np.int64)
    waste = degrees * level - gpus * seconds
    order = np.argsort(-waste, kind="stable")
    pool_ids = np.asarray(pool, dtype=np.int64)[order]
    seconds, tokens, degrees = seconds[order], tokens[order], degrees[order]
    hosts.sort(key=lambda k: -rings[k].degree)
    grown, member, slack, room = _widenings(rings, hosts, lengths, usp, level, capacity, model)
    free = np.ones(pool_ids.size, dtype=bool)
    out = list(rings)
    guests: dict[int, list[list[int]]] = {}
    # whether each pool ring fits each host's members at each widening, alone
    fitting = (seconds[None, None, :] <= slack[:, :, None]) & (tokens[None, None, :]
                                                             <= room[:, :, None])  # fmt: skip
    for row, host in enumerate(hosts):
        open_ = fitting[row] & free[None, :]
        if not open_.any():
            continue
        best, best_saved = None, 0
        for col in np.flatnonzero(open_.any(axis=1)).tolist():
            if col and grown[row, col] == grown[row, col - 1]:
                continue  # the same widening again
            fits = np.flatnonzero(open_[col])
            degree = int(grown[row, col])
            nodes = _first_fit(fits, seconds, tokens, degree // gpus, slack[row, col],
                               int(room[row, col]))  # fmt: skip
            saved = int(sum(degrees[node].sum() for node in nodes)) - (degree - rings[host].degree)
            if saved > best_saved:
                best, best_saved = (degree, float(member[row, col]), nodes), saved
        if best is None:
            continue
        degree, seconds_of, nodes = best
        out[host] = RingGroup(rings[host].members, degree, seconds_of)
        guests[host] = [pool_ids[node].tolist() for node in nodes]
        for node in nodes:
            free[node] = False
    if not guests:
        return None
    guest_seconds = dict(zip(pool_ids.tolist(), seconds.tolist(), strict=True))
    return Hosting(out, guests, guest_seconds)


def _widenings(rings, hosts, lengths, usp, level: float, capacity: int, model: WorkModel):
    """Per host (rows) and widening (columns: none, then `WIDENINGS` even steps up to half
    its degree; a USP group's none only, repeated): its degree, member work, work slack
    under the level and token room (its own kept K/V room, `WorkModel.reserved_tokens`,
    set aside where it has it)."""
    members = [rings[k].members[0] for k in hosts]
    n = lengths[members].astype(np.int64)
    u = np.maximum(usp[members], 1).astype(np.int64)
    degree = np.asarray([rings[k].degree for k in hosts], dtype=np.int64)
    half = degree // 2
    steps = np.maximum(1, -(-half // WIDENINGS))[:, None] * np.arange(WIDENINGS + 1)[None, :]
    widen = np.minimum(steps, half[:, None])
    widen[usp[members] > 0] = 0
    grown = degree[:, None] + widen
    member = np.repeat(np.asarray([[rings[k].member_seconds] for k in hosts]), grown.shape[1],
                       axis=1)  # fmt: skip
    wider = widen > 0
    if wider.any():
        member[wider] = model.alone_ring_seconds(n[np.nonzero(wider)[0]], grown[wider])
    chunk = -(-n[:, None] // grown)
    kept = n[:, None] - (n[:, None] // grown) * u[:, None]
    reserve = model.reserved_tokens(kept, u[:, None])
    room = capacity - chunk - np.where(chunk + reserve <= capacity, reserve, 0)
    return grown, member, level - member, room


def _spread(rings, pool, lengths, node_ring, gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """Member work and tokens of each pool ring's sequences on a ring of G members."""
    owner = np.concatenate([[k] * len(rings[g].members) for k, g in enumerate(pool)])
    seqs = np.concatenate([rings[g].members for g in pool]).astype(np.int64)
    seconds = np.bincount(owner, weights=node_ring[seqs], minlength=len(pool))
    tokens = np.bincount(owner, weights=-(-lengths[seqs] // gpus), minlength=len(pool))
    return seconds, tokens.astype(np.int64)


def _first_fit(candidates, seconds, tokens, nodes: int, slack: float, room: int) -> list[list[int]]:
    """Pool positions (`candidates`, in offer order) each of `nodes` bins of `slack`
    work and `room` tokens takes, first fit."""
    work_left = [slack] * nodes
    room_left = [room] * nodes
    taken: list[list[int]] = [[] for _ in range(nodes)]
    lightest = float(seconds[candidates].min())
    for i in candidates.tolist():
        for b in range(nodes):
            if seconds[i] <= work_left[b] and tokens[i] <= room_left[b]:
                work_left[b] -= float(seconds[i])
                room_left[b] -= int(tokens[i])
                taken[b].append(i)
                break
        if max(work_left) < lightest:
            break
    return taken
