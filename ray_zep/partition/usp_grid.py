"""USP groups the work policy may give a long sequence: ring positions of U GPUs of one
node each (or of several whole nodes, `WorkModel.usp_widths`), exchanging heads inside the
position (Ulysses), with the ring over the positions.

A position of a whole node (U = GPUs per node) takes whole nodes; a position of half a
node (where that splits the heads) lets a group of a few nodes end on half of one more,
so that a sequence one node cannot hold well need not take a second whole node: on
`bench scale`'s 7b arxiv batch at 64 GPUs a 32k-token document is 1.22x the mean work as
a ring on one node, 0.95x as 3 positions of 4 GPUs (12 ranks), 0.64x as 2 positions of 8
(16 ranks); with one such group the plan's busiest rank holds 1.14x the mean FLOPs (was
1.16x), and the step falls from 1.32x to 1.29x its bound. Narrower positions (2 GPUs on
8-GPU nodes) the work model costs at up to 1.7x what the simulator plays, and on the
grid, costed at their NICs' own rate instead, they waited more than they saved (7b 64
GPUs arxiv 1.29x -> 1.37x). A group's member work depends on its sequence's length
alone, so the level scan costs every candidate group once per batch (`UspGrid`).

A position of s whole nodes (U = s G, where the heads split that far, s up to
`WIDE_SPAN`) cuts the K/V every node imports for the sequence to 1 / s, since each node
attends with 1 / s of the heads; its all-to-alls cross the NICs. It pays for the longest
documents, whose rings of one-node positions are bound by that import at any width: on
`bench scale`'s 7b chat batch at 1,024 GPUs the 242k-token document's member work is 1.56x
the mean as 32 positions of a node (1.48x of it waiting on the NICs) and 0.98x as 16
positions of two nodes. A group of wider positions may take as many ranks as one of
narrower ones; of the groups with the fewest ranks at the level, the lightest is chosen.

A group of one-node positions may be within the level and still set the step: a step
waits for the forward's slowest rank, then the backward's, and such a group's forward
waits on its hops (where its members keep their peers' K/V, its backward sends only the
gradients). Where its forward passes `FORWARD_SHARE` of the level, the group of wider
positions with the fewest ranks whose work and forward are both within it is taken
instead, even with more ranks (`UspGrid._wide_for_hops`). On `bench scale`'s grid (4k
tokens per GPU) no row of 64 or 256 GPUs moves. At 1,024 GPUs 13b github's 242k- and
239k-token documents take 3 positions of five nodes each (120 ranks) for 14 and 13
one-node ones, and the row trains 2.7% more tokens a second; 13b chat 3.4% more, 7b
arxiv 0.1% fewer; at 4,096 GPUs the chat rows 6.7-8.7% more. Checked on every group, not
only where a wider one can take it, the forward held other groups at more ranks and
three 7b rows lost 1.4-3.5%; a forward that also counts the weights' collectives on the
NICs took wide positions the simulator plays slower: seven of eight rows at 1,024 GPUs
lost 4-21% (BENCHMARKS.md, fortieth series).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_zep.partition.work import FORWARD_SHARE, WorkModel
from ray_zep.topology import Topology

MIN_GAIN = 0.03
"""A ring grows only while that lowers its member work by at least this share; a USP
group replaces a ring of as many ranks only where it is lighter by this share."""
USP_NODES = (*range(2, 33), 40, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512)
"""Node counts a group of whole-node positions is costed at (the fewest at the level
wins): every count up to 32, where one node more or less is a large share of a group (on
`bench scale`'s grid, 13b 256 GPUs chat 4k 2.79 -> 2.23 step / bound over the coarser 2,
3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32), coarser beyond."""
NARROW_SPAN_NODES = 4
"""Groups of half-node positions are costed up to this many nodes' GPUs: beyond it half
a node more or less is a small share of the group."""


@dataclass(frozen=True)
class UspGrid:
    """A USP member's work for the sequences a level may split, at each candidate group
    (inf where the group lacks the tokens' room), columns by ranks, then widest
    positions first."""

    widths: np.ndarray
    """U of each column."""
    positions: np.ndarray
    """Ring positions of each column."""
    seconds: np.ndarray
    """One row per candidate sequence, one column per group."""
    row: np.ndarray
    """Each sequence's row of `seconds`; -1 for those no level splits."""
    forward: np.ndarray
    """The forward's part of `seconds` (`WorkModel.usp_group_forward_seconds`)."""
    gpus: int
    """GPUs per node: positions of U = `gpus` are one node each, wider ones several."""

    @property
    def degrees(self) -> np.ndarray:
        """Ranks of each column's group."""
        return self.widths * self.positions

    @classmethod
    def of(
        cls,
        lengths: np.ndarray,
        candidates: np.ndarray,
        capacity: int,
        topology: Topology,
        model: WorkModel,
    ) -> UspGrid | None:
        """The grid of `lengths`, computed where `candidates` (the sequences any level
        may split) holds; None where no group fits the topology and the model's heads."""
        gpus = topology.gpus_per_node
        columns = []
        for u in model.usp_widths():
            if u == gpus:
                columns += [(u, p) for p in USP_NODES if p <= topology.nodes]
            elif u > gpus:  # positions of several whole nodes (one: plain Ulysses)
                span = u // gpus
                columns += [(u, p) for p in (1, *USP_NODES) if p * span <= topology.nodes]
            elif 2 * u == gpus:
                most = min(NARROW_SPAN_NODES, topology.nodes) * gpus
                columns += [(u, p) for p in range(gpus // u + 1, most // u + 1) if u * p % gpus]
        if not columns:
            return None
        columns.sort(key=lambda c: (c[0] * c[1], -c[0]))
        widths = np.asarray([c[0] for c in columns], dtype=np.int64)
        positions = np.asarray([c[1] for c in columns], dtype=np.int64)
        rows = np.flatnonzero(candidates)
        n = lengths[rows]
        k = widths.size
        tokens, at = np.repeat(n, k).astype(np.float64), np.tile(positions, n.size)
        grid, forward = (part.reshape(n.size, k) for part in model.usp_group_costs(
            model.ring_parts(tokens, at), tokens, at, np.tile(widths, n.size)))  # fmt: skip
        seconds = np.where(n[:, None] <= (widths * positions)[None, :] * capacity, grid, np.inf)
        row = np.full(lengths.size, -1, dtype=np.int64)
        row[rows] = np.arange(rows.size)
        return cls(widths, positions, seconds, row, forward, gpus)

    def choose(
        self, seqs: np.ndarray, degrees: np.ndarray, member: np.ndarray, level: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(degrees, member work, U: 0 for a ring) of the rings of `seqs` once USP groups
        compete: per sequence, the fewest-rank group whose member work is at most `level`
        (or the least work, within `MIN_GAIN`, where none is; the lightest where groups
        of positions of different widths take as many ranks; wider positions for a
        one-node group whose forward passes its share, `_wide_for_hops`), taken over the
        ring where it needs fewer ranks at the level (on as many, or where neither
        reaches it: the lesser work by `MIN_GAIN`; the ring on near ties, which has no
        all-to-alls)."""
        rows = self.row[seqs]
        assert (rows >= 0).all(), "a level split a sequence the USP grid left out"
        grid = self.seconds[rows]
        at_level = grid <= level
        near_least = grid <= grid.min(axis=1, keepdims=True) * (1 + MIN_GAIN)
        wanted = np.where(at_level.any(axis=1, keepdims=True), at_level, near_least)
        pick = self._wide_for_hops(rows, _least_of_fewest(wanted, self.degrees, grid), level)
        usp_work = grid[np.arange(seqs.size), pick]
        usp_degree = self.degrees[pick]
        ring_in, usp_in = member <= level, usp_work <= level
        lighter = usp_work < member * (1 - MIN_GAIN)  # near ties: the ring (no all-to-alls)
        fewer = (usp_degree < degrees) | ((usp_degree == degrees) & lighter)
        usp = np.where(ring_in & usp_in, fewer, np.where(ring_in | usp_in, usp_in, lighter))
        usp &= np.isfinite(usp_work)
        return (
            np.where(usp, usp_degree, degrees),
            np.where(usp, usp_work, member),
            np.where(usp, self.widths[pick], 0),
        )

    def _wide_for_hops(self, rows: np.ndarray, pick: np.ndarray, level: float) -> np.ndarray:
        """`pick` with each group of one-node positions whose forward passes
        `FORWARD_SHARE` of the level replaced by the group of wider positions with the
        fewest ranks (the lightest on ties) that keeps both its work and its forward within
        the level, where there is one (module docstring)."""
        grid, forward = self.seconds[rows], self.forward[rows]
        chosen = np.arange(rows.size)
        heavy = (self.widths[pick] == self.gpus) & (forward[chosen, pick] > FORWARD_SHARE * level)
        wide = (self.widths > self.gpus)[None, :] & (grid <= level)
        wide &= forward <= FORWARD_SHARE * level
        heavy &= wide.any(axis=1)
        if not heavy.any():
            return pick
        pick = pick.copy()
        pick[heavy] = _least_of_fewest(wide[heavy], self.degrees, grid[heavy])
        return pick


def _least_of_fewest(wanted: np.ndarray, degrees: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Per row, the column of least work (`grid`) among the `wanted` ones of the fewest
    ranks (`degrees`): groups of positions of whole nodes and of several whole nodes may
    take as many ranks. `wanted` holds at least one column per row."""
    ranks = np.where(wanted, degrees[None, :], np.iinfo(np.int64).max)
    fewest = wanted & (ranks == ranks.min(axis=1, keepdims=True))
    return np.where(fewest, grid, np.inf).argmin(axis=1)


def positions_in_nodes(ranks: tuple[int, ...], width: int, gpus: int) -> bool:
    """Every run of `width` consecutive `ranks` (a ring position) lies in one node, or,
    where `width` is a multiple of the node's GPUs, is made of whole nodes."""
    members = np.asarray(ranks).reshape(-1, width)
    if width > gpus and width % gpus == 0:
        nodes = members.reshape(-1, gpus)
        whole = (nodes[:, 0] % gpus == 0) & (nodes == nodes[:, :1] + np.arange(gpus)).all(axis=1)
        return bool(whole.all())
    nodes = members // gpus
    return bool((nodes == nodes[:, :1]).all())
