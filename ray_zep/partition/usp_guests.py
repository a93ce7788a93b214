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
  and no host holds them beside its own; they host guests themselves once these hosts
  have taken theirs (`ray_zep.partition.wide_guests`).

On `bench scale`'s grid (64-4,096 GPUs, 4k tokens per GPU; BENCHMARKS.md, thirty-ninth
series):
- 13b prolong64k at 1,024 GPUs trains 6.9% more tokens a second, 13b github at 64 GPUs
  10.4% more, and eight more rows 0.5-3.0% more;
- 13b arxiv at 1,024 and 4,096 GPUs trains 0.7% and 0.9% fewer: there the plan kept a
  lower level than before, which the simulator played slower.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from ray_zep.partition.guest_kernel import GROWTH, costs_of, guest_kernel
from ray_zep.partition.wide_guests import wide_guests
from ray_zep.partition.work import WorkModel


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

    def rows(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For sequences `seqs` (batch indices): each one's row of `values`, its tokens
        and its whole work."""
        return self._row[seqs], self.lengths[seqs], self.work[seqs]

    @property
    def values(self) -> np.ndarray:
        """3 x rows x counts: each row's ring parts (diagonal, step, send) at each count of
        positions made `ready`."""
        return self._values

    @property
    def done(self) -> np.ndarray:
        """Which counts of positions are `ready`."""
        return self._done

    @cached_property
    def constants(self) -> np.ndarray:
        """The model's numbers a host's costs read (`guest_kernel.costs_of`)."""
        return costs_of(self.model)


def usp_guests(
    seqs: np.ndarray,
    degrees: np.ndarray,
    member: np.ndarray,
    usp: np.ndarray,
    level: float,
    capacity: int,
    gpus: int,
    table: PartsTable,
    world: int,
    whole_work: float = 0.0,
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
        world: the ranks there are, and `whole_work` the level's whole sequences' work
            (seconds; `ray_zep.partition.wide_guests`).

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
    if hosts.size and guests.size:
        joined = _whole_node_guests(seqs, host_of, degrees, seconds, hosts, guests, level,
                                    capacity, gpus, table)  # fmt: skip
        host_of, degrees, seconds = joined
    wide_guests(seqs, degrees, seconds, usp, host_of, level, capacity, gpus, table, world,
                whole_work)  # fmt: skip
    return host_of, degrees, seconds


def _whole_node_guests(seqs, host_of, degrees, seconds, hosts, guests, level, capacity, gpus,
                       table):  # fmt: skip
    """`usp_guests` for hosts of whole-node positions (`guest_kernel`): (host_of, degrees,
    seconds) as those hosts' guests make them."""
    base = degrees[hosts] // gpus
    # guests in turn, `CHUNK` at a time: whether each fits each host at each offset, and
    # the host's member work then; joining only adds to a host, so a guest that fits none
    # as they stand fits none later
    guests = guests[np.lexsort((-table.lengths[seqs[guests]], -degrees[guests]))]  # most first
    positions = base[:, None] + np.arange(GROWTH + 1)[None, :]  # no more than there are nodes
    table.ready(np.where(positions <= table.nodes, positions, base[:, None]).ravel())
    row, lengths, work = table.rows(seqs)
    while True:  # again where a host grew to positions whose parts are not worked out
        out = host_of.copy(), degrees.copy(), seconds.copy()
        missing = guest_kernel(row, lengths, work, table.values, table.done, hosts, base.copy(),
                               guests, out[1], out[2], out[0], float(level), int(capacity),
                               gpus, table.nodes, table.constants)  # fmt: skip
        if not missing:
            return out
        table.ready(np.arange(missing, min(missing + GROWTH, table.nodes) + 1))
