"""Split sequences that join a USP group of whole-node positions as its guests
(`ray_zep.partition.balance`).

A level gives each sequence it splits the fewest ranks whose member work is at most the
level: a ring inside a node, a group of half-node positions, or a group of whole-node
positions (USP). The degrees come in steps, so many of those ranks sit well under the
level. A 52k-token document (13b, L = 6,400) takes two nodes at 0.66x the mean rank's
work, and a 35k-token one a ring of 7 GPUs of a third node.

Such a group of whole-node positions (the host) may take other split sequences (guests)
on its own ranks. The guests' own ranks are then freed for the rest of the level.
- The host's item holds them all: each ring step forwards every sequence's chunk and
  computes every block, and one all-to-all moves all the rows (one queue item,
  `AttentionPlan.items`; the engine runs any number of sequences in an item).
- Its member work is costed as one group over the sequences' summed ring parts
  (`WorkModel.usp_group_seconds`), and a guest joins only where that stays within the
  level and each member's tokens within L.
- Guests are offered by the ranks they free, most first. Each joins the host it leaves
  the least work room in (best fit), at the host's own positions.
- Hosts are groups not at their floor.
- Guests are the rings and the groups of positions narrower than a node; groups of
  positions wider than a node take the batch's longest documents, which no host holds
  beside its own.

On `bench scale`'s 1,024-GPU batches (4k tokens per GPU) at level 1.2x, the split
sequences of 13b prolong64k take 1,063 ranks on their own groups and 1,007 with guests;
those of 7b arxiv at 1.15x take 1,049 and 1,009.
"""

from __future__ import annotations

import numpy as np

from ray_zep.costmodel import BACKWARD_LINEAR_FACTOR
from ray_zep.partition.work import RingParts, WorkModel

GROWTH = 1
"""Whole nodes a host may add for its guests (each time fewer ranks than the guest's own
group takes)."""
OFFSETS = np.arange(GROWTH + 1)
FORWARD_SHARE = 1.0 / (1.0 + BACKWARD_LINEAR_FACTOR)
"""The most of the level a host's forward may take with its guests: a rank's linear
modules' forward share (its attention's is smaller). A step waits for the forward's
slowest rank, then the backward's, so a host whose forward waits on its hops sets the
forward even where its member work, forward and backward, is within the level."""


class PartsTable:
    """The ring parts (`WorkModel.ring_parts`) of a batch's sequences at 1 to `nodes`
    positions, each count worked out once for all of them, when first asked for (a
    level scan asks for the same ones at every level)."""

    def __init__(
        self, lengths: np.ndarray, candidates: np.ndarray, nodes: int, model: WorkModel
    ) -> None:
        """`candidates`: the sequences any level may split (the only ones asked for)."""
        self.lengths = np.asarray(lengths, dtype=np.float64)
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
    # whether each guest fits each host at each offset, and the host's member work then;
    # a join changes only its host's column, and joining only adds to a host, so a guest
    # that fits none as they stand fits none later
    fits, cost = groups.evaluate(seqs[guests], degrees[guests], level, capacity)
    first = 0
    while first < guests.size:
        fitting = fits[first:].reshape(guests.size - first, -1).any(axis=1)
        if not fitting.any():
            break
        row = first + int(fitting.argmax())
        offset = np.where(fits[row].any(axis=1), fits[row].argmax(axis=1), GROWTH + 1)
        least = offset == offset.min()  # the hosts it adds fewest ranks to
        chosen = cost[row, np.arange(hosts.size), np.minimum(offset, GROWTH)]
        k = int(np.where(least, chosen, -np.inf).argmax())  # of those, the fullest
        guest = int(guests[row])
        groups.join(k, int(seqs[guest]), int(offset[k]))
        host_of[guest] = hosts[k]
        seconds[hosts[k]] = cost[row, k, offset[k]]
        degrees[hosts[k]] = groups.base[k] * gpus
        first = row + 1
        rest = guests[first:]
        fits[first:, k], cost[first:, k] = groups.evaluate(seqs[rest], degrees[rest], level,
                                                           capacity, k)  # fmt: skip
    return host_of, degrees, seconds


class _Groups:
    """The hosts' groups as guests join them: per host (rows) at its positions plus each
    offset (columns), its sequences' ring parts summed, their tokens, and the most tokens
    a member holds (each sequence's share rounded up)."""

    def __init__(self, seqs, hosts, base, gpus: int, table: PartsTable) -> None:
        self.table, self.gpus = table, gpus
        self.base = base.copy()
        table.ready(self.positions().ravel())
        self.held = [[int(seqs[h])] for h in hosts.tolist()]  # each host's sequences
        self.sums = [np.zeros((hosts.size, OFFSETS.size)) for _ in range(5)]
        for k in range(hosts.size):
            self._count(k)

    def positions(self, rows=slice(None)) -> np.ndarray:
        """Each host's positions plus each offset (at most the cluster's nodes: an offset
        past them reads the host's own count and is refused, `evaluate`)."""
        positions = self.base[rows, None] + OFFSETS[None, :]
        return np.where(positions <= self.table.nodes, positions, self.base[rows, None])

    def _count(self, k: int) -> None:
        members = np.asarray(self.held[k])
        positions = np.broadcast_to(self.positions([k]), (members.size, OFFSETS.size))
        seqs = np.broadcast_to(members[:, None], positions.shape)
        parts = self.table.parts(seqs, positions)
        tokens = self.table.lengths[seqs]
        shares = np.ceil(tokens / (positions * self.gpus))
        for mine, values in zip(self.sums, (parts.diagonal_s, parts.step_s, parts.send_bytes,
                                            tokens, shares), strict=True):  # fmt: skip
            mine[k] = values.sum(axis=0)

    def evaluate(self, seqs: np.ndarray, own: np.ndarray, level: float, capacity: int,
                 host: int | slice = slice(None)):  # fmt: skip
        """(fits, member seconds) of each of `seqs` (own degrees `own`) joining the hosts
        (or the one `host`) at each offset, as they stand: guests x hosts x offsets (or
        guests x offsets)."""
        positions = self.positions(host)  # hosts x offsets (or 1 x offsets)
        if isinstance(host, int):
            positions = positions[0]
        shape = (seqs.size, *positions.shape)
        column = (-1, *([1] * positions.ndim))  # one guest per row, broadcast over the rest
        seq = np.broadcast_to(seqs.reshape(column), shape)
        positions = np.broadcast_to(positions, shape)
        theirs = self.table.parts(seq, positions)
        mine = [total[host] for total in self.sums]
        together = RingParts(mine[0] + theirs.diagonal_s, mine[1] + theirs.step_s,
                             mine[2] + theirs.send_bytes)  # fmt: skip
        n = self.table.lengths[seq]
        tokens = mine[3] + n
        held = mine[4] + np.ceil(n / (positions * self.gpus))
        model = self.table.model
        cost, forward = model.usp_group_costs(together, tokens, positions, self.gpus)
        fits = (cost <= level) & (forward <= level * FORWARD_SHARE) & (held <= capacity)
        fits &= OFFSETS * self.gpus < own.reshape(column)  # fewer ranks than its own group
        fits &= self.base[host, None] + OFFSETS <= self.table.nodes  # no more nodes than exist
        return fits, cost

    def join(self, k: int, seq: int, grown: int) -> None:
        """Sequence `seq` joins host `k`, which takes `grown` more nodes."""
        self.held[k].append(seq)
        self.base[k] += grown
        self.table.ready(self.positions([k]).ravel())
        self._count(k)
