"""Split sequences that join a USP group of whole-node positions as its guests
(`ray_zep.partition.balance`).

A level gives each sequence it splits the fewest ranks whose member work is at most the
level: a ring inside a node, a group of half-node positions, or a group of whole-node
positions (USP). Those degrees come in steps, so many groups sit well under the level.
On `bench scale`'s 13b prolong64k batch at 1,024 GPUs (L = 6,400), a 54,477-token
document takes two whole nodes and a 43,056-token one three half-node positions: 28 ranks.

A group of whole-node positions (the host) may take other split sequences (guests) on
its own ranks, and the guests' own ranks are freed for the rest of the level. The two
documents above share three nodes: 24 ranks.
- The host's item holds them all. Each ring step forwards every sequence's chunk and
  computes every block, and one all-to-all moves all the rows (one queue item,
  `AttentionPlan.items`; the engine runs any number of sequences in an item).
- The shared group's member work is costed over the sequences' summed ring parts
  (`WorkModel.usp_group_seconds`).
- A guest joins only where that work stays within the level and each member's tokens
  within L. The host may take one more node for it (`GROWTH`), where that is fewer ranks
  than the guest's own group.
- The group's forward must also stay within `FORWARD_SHARE` of the level, since a step
  waits for the slowest rank of each phase in turn. Without this check, 7b arxiv at
  1,024 GPUs stepped 4.6% slower (1.874 -> 1.961 s): its forward ended on a group of four
  positions holding three documents, which waited on its hops for 7.9 of 20.5 ms.
- Guests are offered by the ranks they free, most first. Each joins the host it adds
  the fewest ranks to, and of those the one it leaves the least work room in.
- The level takes guests only where its split sequences' own groups need more ranks
  than there are (`balance`). Elsewhere guests free ranks the plan does not need: taken
  at every level, they made 13b chat at 1,024 GPUs step 1.6% slower, and 7b chat at 256
  and 1,024 GPUs 1.3% and 0.5%.
- Hosts are groups not at their floor. Guests are rings and groups of half-node
  positions. Groups of positions wider than a node hold the batch's longest documents,
  and no host holds them beside its own.

On `bench scale`'s grid (64-4,096 GPUs, 4k tokens per GPU; BENCHMARKS.md, thirty-ninth
series):
- 13b prolong64k at 1,024 GPUs trains 6.9% more tokens a second, 13b github at 64 GPUs
  10.4% more, and eight more rows 0.5-3.0% more;
- 13b arxiv at 1,024 and 4,096 GPUs trains 0.7% and 0.9% fewer: there the plan kept a
  lower level than before, which the simulator played slower.
"""

from __future__ import annotations

import numpy as np

from ray_zep.partition.work import FORWARD_SHARE, RingParts, WorkModel

GROWTH = 1
"""Whole nodes a host may add for its guests (each time fewer ranks than the guest's own
group takes)."""
OFFSETS = np.arange(GROWTH + 1)
CHUNK = 64
"""Guests weighed against every host at once: the later ones only once the earlier have
joined or fit nowhere, by when the hosts have less room (at 4,096 GPUs most of several
hundred fit none)."""


class PartsTable:
    """The ring parts (`WorkModel.ring_parts`) of a batch's sequences at 1 to `nodes`
    positions, each count worked out once for all of them, when first asked for (a
    level scan asks for the same ones at every level)."""

    def __init__(
        self,
        lengths: np.ndarray,
        work: np.ndarray,
        candidates: np.ndarray,
        nodes: int,
        model: WorkModel,
    ) -> None:
        """`work`: each sequence's whole (`WorkModel.whole_seconds`); `candidates`: the
        sequences any level may split (the only ones asked for)."""
        self.lengths = np.asarray(lengths, dtype=np.float64)
        self.work = np.asarray(work, dtype=np.float64)
        self.nodes, self.model = nodes, model
        rows = np.flatnonzero(candidates)
        self._split = self.lengths[rows]
        self._row = np.full(self.lengths.size, -1, dtype=np.int64)
        self._row[rows] = np.arange(rows.size)
        self._values = np.zeros((3, rows.size, nodes + 1))  # diagonal, step, send
        self._done = np.zeros(nodes + 1, dtype=bool)

    def ready(self, counts: np.ndarray) -> None:
        """Works out the parts at each of `counts` positions not yet worked out."""
        missing = np.unique(counts[~self._done[counts]])
        for count in missing.tolist():
            parts = self.model.ring_parts(self._split, np.full(self._split.size, count))
            self._values[:, :, count] = (parts.diagonal_s, parts.step_s, parts.send_bytes)
            self._done[count] = True

    def parts(self, seqs: np.ndarray, positions: np.ndarray) -> RingParts:
        """The parts of sequences `seqs` (batch indices) at `positions` each (same shape;
        every count made `ready`)."""
        values = self._values[:, self._row[seqs], positions]
        return RingParts(values[0], values[1], values[2])


def usp_guests(
    seqs: np.ndarray,
    degrees: np.ndarray,
    member: np.ndarray,
    usp: np.ndarray,
    level: float,
    capacity: int,
    gpus: int,
    table: PartsTable,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The host each split sequence joins as a guest (module docstring), and every split
    sequence's degree and member seconds with the guests.

    Args:
        seqs: the split sequences (batch indices into `table`).
        degrees: ranks of each one's own group.
        member: each one's member seconds on it.
        usp: U of each one's USP group, 0 for a ring.
        level: the most work a member may carry.
        capacity: L.
        gpus: GPUs per node.
        table: the batch's ring parts.

    Returns:
        (host: the index (into `seqs`) of the sequence whose group each joins, -1 for
        none; degrees and seconds: `degrees` and `member` with each host's as its guests
        make them).
    """
    host_of = np.full(seqs.size, -1, dtype=np.int64)
    degrees = np.asarray(degrees, dtype=np.int64).copy()
    seconds = np.asarray(member, dtype=np.float64).copy()
    hosts = np.flatnonzero((usp == gpus) & (member <= level))
    guests = np.flatnonzero(usp < gpus)
    if not hosts.size or not guests.size:
        return host_of, degrees, seconds
    groups = _Groups(seqs, hosts, degrees[hosts] // gpus, gpus, table)
    guests = guests[np.lexsort((-table.lengths[seqs[guests]], -degrees[guests]))]  # most first
    # guests in turn, `CHUNK` at a time: whether each fits each host at each offset, and
    # the host's member work then; joining only adds to a host, so a guest that fits none
    # as they stand fits none later
    for start in range(0, guests.size, CHUNK):
        chunk = guests[start : start + CHUNK]
        chunk = chunk[groups.may_fit(seqs[chunk], degrees[chunk], level, capacity)]
        if not chunk.size:
            continue
        fits, cost = groups.evaluate(seqs[chunk], degrees[chunk], level, capacity)
        alive = np.flatnonzero(fits.reshape(chunk.size, -1).any(axis=1))
        while alive.size:
            # in rounds: each guest in turn joins the host it chooses unless another
            # joined that host this round (it then chooses again, on the host as it is)
            chosen, offsets = _choices(fits[alive], cost[alive])
            touched = np.zeros(hosts.size, dtype=bool)
            waiting = []
            for row, k, offset in zip(alive.tolist(), chosen.tolist(), offsets.tolist(),
                                      strict=True):  # fmt: skip
                if touched[k]:
                    waiting.append(row)
                    continue
                touched[k] = True
                guest = int(chunk[row])
                groups.join(k, int(seqs[guest]), offset)
                host_of[guest] = hosts[k]
                seconds[hosts[k]] = cost[row, k, offset]
                degrees[hosts[k]] = groups.base[k] * gpus
            alive = np.asarray(waiting, dtype=np.int64)
            if alive.size:
                changed = np.flatnonzero(touched)
                rest = chunk[alive]
                fit, then = groups.evaluate(seqs[rest], degrees[rest], level, capacity, changed)
                fits[alive[:, None], changed], cost[alive[:, None], changed] = fit, then
                alive = alive[fits[alive].reshape(alive.size, -1).any(axis=1)]
    return host_of, degrees, seconds


def _choices(fits: np.ndarray, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per guest (rows of guests x hosts x offsets), the host it joins and at which
    offset: of the hosts it fits, those it adds the fewest ranks to, and of those the
    one it leaves the least work room in."""
    fitting = fits.any(axis=2)
    offset = np.where(fitting, fits.argmax(axis=2), GROWTH + 1)
    least = offset == offset.min(axis=1, keepdims=True)
    then = np.take_along_axis(cost, np.minimum(offset, GROWTH)[..., None], axis=2)[..., 0]
    host = np.where(least & fitting, then, -np.inf).argmax(axis=1)
    return host, offset[np.arange(host.size), host]


class _Groups:
    """The hosts' groups as guests join them: per host (rows) at its positions plus each
    offset (columns), its sequences' ring parts summed, their tokens, and the most tokens
    a member holds (each sequence's share rounded up)."""

    def __init__(self, seqs, hosts, base, gpus: int, table: PartsTable) -> None:
        self.table, self.gpus = table, gpus
        self.base = base.copy()
        positions = self.positions()
        table.ready(positions.ravel())
        self.held = [[int(seqs[h])] for h in hosts.tolist()]  # each host's sequences
        # each host's own sequence alone, every host at once
        own = np.broadcast_to(seqs[hosts][:, None], positions.shape)
        self.sums = [np.array(values, dtype=np.float64)
                     for values in self._shares(own, positions)]  # fmt: skip

    def positions(self, rows=slice(None)) -> np.ndarray:
        """Each host's positions plus each offset (at most the cluster's nodes: an offset
        past them reads the host's own count and is refused, `evaluate`)."""
        positions = self.base[rows, None] + OFFSETS[None, :]
        return np.where(positions <= self.table.nodes, positions, self.base[rows, None])

    def _shares(self, seqs: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, ...]:
        """What sequences `seqs` add to a group at `positions` each (same shape), as
        `sums` counts it: their ring parts, their tokens, and their share of a member's
        tokens rounded up."""
        parts = self.table.parts(seqs, positions)
        tokens = self.table.lengths[seqs]
        shares = np.ceil(tokens / (positions * self.gpus))
        return parts.diagonal_s, parts.step_s, parts.send_bytes, tokens, shares

    def _count(self, k: int) -> None:
        members = np.asarray(self.held[k])
        positions = np.broadcast_to(self.positions([k]), (members.size, OFFSETS.size))
        seqs = np.broadcast_to(members[:, None], positions.shape)
        for mine, values in zip(self.sums, self._shares(seqs, positions), strict=True):
            mine[k] = values.sum(axis=0)

    def may_fit(self, seqs: np.ndarray, own: np.ndarray, level: float, capacity: int):
        """Whether each of `seqs` (own degrees `own`) passes a quick test of fitting some
        host as the hosts stand: each host's member work alone at each offset plus the
        sequence's whole work spread over the host's GPUs (what it adds at least: split,
        its blocks run no faster), and the forward alone plus the linear modules' forward
        of its share of tokens, within the level, and the members' tokens within L."""
        positions = self.positions()
        model = self.table.model
        parts = RingParts(self.sums[0], self.sums[1], self.sums[2])
        cost, forward = model.usp_group_costs(parts, self.sums[3], positions, self.gpus)
        members = (positions * self.gpus)[None]
        share = self.table.lengths[seqs][:, None, None] / members
        spread = self.table.work[seqs][:, None, None] / members
        fits = (cost + spread <= level) & (self.sums[4] + np.ceil(share) <= capacity)
        fits &= forward + model.linear_seconds(share) * FORWARD_SHARE <= level * FORWARD_SHARE
        fits &= OFFSETS * self.gpus < own[:, None, None]
        return fits.reshape(seqs.size, -1).any(axis=1)

    def evaluate(self, seqs: np.ndarray, own: np.ndarray, level: float, capacity: int,
                 hosts: slice | np.ndarray = slice(None)):  # fmt: skip
        """(fits, member seconds) of each of `seqs` (own degrees `own`) joining the hosts
        (those of `hosts`) at each offset, as they stand: guests x hosts x offsets."""
        positions = self.positions(hosts)  # hosts x offsets
        self.table.ready(positions.ravel())
        shape = (seqs.size, *positions.shape)
        seq = np.broadcast_to(seqs[:, None, None], shape)
        positions = np.broadcast_to(positions, shape)
        together = [total[hosts] + added for total, added in
                    zip(self.sums, self._shares(seq, positions), strict=True)]  # fmt: skip
        cost, forward = self.table.model.usp_group_costs(RingParts(*together[:3]), together[3],
                                                         positions, self.gpus)  # fmt: skip
        fits = (cost <= level) & (forward <= level * FORWARD_SHARE) & (together[4] <= capacity)
        fits &= OFFSETS * self.gpus < own[:, None, None]  # fewer ranks than its own group
        fits &= self.base[hosts, None] + OFFSETS <= self.table.nodes  # no more nodes than exist
        return fits, cost

    def join(self, k: int, seq: int, grown: int) -> None:
        """Sequence `seq` joins host `k`, which takes `grown` more nodes."""
        self.held[k].append(seq)
        if grown:
            self.base[k] += grown
            self.table.ready(self.positions([k]).ravel())
            self._count(k)
            return
        positions = self.positions([k])[0]
        for mine, added in zip(self.sums, self._shares(np.full(positions.shape, seq), positions),
                               strict=True):  # fmt: skip
            mine[k] += added
