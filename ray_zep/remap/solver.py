"""The remapping layer's transfer matrix (Zeppelin §3.4, eq. 2), solved exactly with ortools.

Given the attention layout's token counts A over d ranks, the linear layout
holds B: floor(mean) tokens on every rank and one more on the sum(A) mod d
ranks with the most tokens (ties: lower rank), so every rank ends with
floor(mean) or ceil(mean) and the fullest ranks send the least. Only surplus
ranks (A_i > B_i) send, only deficit ranks receive, and the transfer matrix M
minimises the largest per-rank sending cost max_i sum_j T_ij M_ij with
integral entries, where T_ij is the seconds per token over an intra-node link
(same node) or a NIC (different nodes).

Because T takes two values, a sender's cost is c_intra s_i + (c_inter -
c_intra) x_i, with s_i its surplus and x_i the tokens it sends off its node.
Whether a bound z on the largest cost is reachable is a max-flow question:
source -> sender (s_i) -> its node (intra, up to s_i) or its node's exit hub
(inter, up to the x_i the bound allows) -> any other node -> sink (the node's
deficit). Integral capacities give an integral flow. The least feasible z is
one of the values c_intra s_i + (c_inter - c_intra) k; a bisection narrows the
interval until it holds one such value, which is then the optimum. Tokens go
to receivers node by node in rank order, so the solution is deterministic.

Token order: a sender keeps its first B_i tokens and sends its tail, piece by
piece to ascending destinations; a receiver appends what it gets after its own
tokens, in ascending source order. The inverse moves the same ranges back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ray_zep.costmodel import kv_bytes_per_token, q_bytes_per_token
from ray_zep.errors import PlacementError
from ray_zep.model_shapes import ModelShape
from ray_zep.topology import Topology

UNBOUNDED = 1 << 40
"""Capacity of arcs that never limit the flow (more than any token count)."""


@dataclass(frozen=True)
class RemapPlan:
    """The transfer between the attention layout and the balanced linear layout.

    Attributes:
        counts_before: tokens per rank in the attention layout (A).
        counts_after: tokens per rank in the linear layout (B).
        transfers: (src, dst, tokens), sorted by source then destination.
        max_rank_cost: the largest per-rank sending cost, seconds.
        solve_seconds: wall time of the solver.
    """

    counts_before: tuple[int, ...]
    counts_after: tuple[int, ...]
    transfers: tuple[tuple[int, int, int], ...]
    max_rank_cost: float
    solve_seconds: float

    def to_dict(self) -> dict[str, object]:
        return {
            "counts_before": list(self.counts_before),
            "counts_after": list(self.counts_after),
            "transfers": [list(t) for t in self.transfers],
            "max_rank_cost": self.max_rank_cost,
            "solve_ms": self.solve_seconds * 1e3,
        }

    def moved_tokens(self) -> int:
        return sum(t[2] for t in self.transfers)


def balanced_counts(counts: np.ndarray) -> np.ndarray:
    """B: floor(mean) everywhere, plus one on the sum mod d fullest ranks (ties: lower rank)."""
    d = len(counts)
    base, extra = divmod(int(counts.sum()), d)
    target = np.full(d, base, dtype=np.int64)
    fullest = np.lexsort((np.arange(d), -counts))[:extra]
    target[fullest] += 1
    return target


def remap_token_bytes(shape: ModelShape) -> int:
    """Bytes a moved token carries into attention: its q, k and v (see
    `ray_zep.attention.remap_exchange`)."""
    return q_bytes_per_token(shape) + kv_bytes_per_token(shape)


def token_costs(topology: Topology, token_bytes: int) -> tuple[float, float]:
    """Seconds per token over an intra-node link and over a NIC shared by its GPUs."""
    sharing = max(len(topology.gpus_on_nic(n)) for n in range(topology.nics_per_node))
    intra = token_bytes / topology.intra_node_bandwidth
    inter = token_bytes * sharing / topology.nic_bandwidth
    return intra, max(inter, intra)


def solve_remap(counts, topology: Topology, token_bytes: int) -> RemapPlan:
    """The optimal transfer from `counts` (attention layout) to the balanced layout.

    Args:
        counts: tokens per rank, one entry per rank of `topology`.
        topology: sets which ranks share a node.
        token_bytes: bytes one token moves (what crosses the wire per token).

    Raises:
        PlacementError: `counts` does not have one non-negative entry per rank.
    """
    started = time.perf_counter()
    before = np.asarray(counts, dtype=np.int64)
    if before.shape != (topology.world_size,) or (before < 0).any():
        raise PlacementError(
            f"remap needs {topology.world_size} non-negative token counts, got {before.tolist()}"
        )
    after = balanced_counts(before)
    intra, inter = token_costs(topology, token_bytes)
    flows = _TransferFlow(before - after, topology, intra, inter)
    transfers, cost = flows.solve()
    return RemapPlan(
        tuple(int(c) for c in before),
        tuple(int(c) for c in after),
        transfers,
        cost,
        time.perf_counter() - started,
    )


def max_flow_library():
    """ortools' max-flow solver, imported at a process's first solve (70 ms; a command
    that never remaps does not pay it)."""
    from ortools.graph.python import max_flow

    return max_flow


class _TransferFlow:
    """The max-flow network of the module docstring, for one surplus vector."""

    def __init__(self, surplus: np.ndarray, topology: Topology, intra: float, inter: float) -> None:
        self.topology = topology
        self.intra, self.inter = intra, inter
        self.nodes = np.arange(len(surplus)) // topology.gpus_per_node  # node_of, every rank
        self.senders = np.flatnonzero(surplus > 0)
        self.receivers = np.flatnonzero(surplus < 0)
        self.supply = surplus[self.senders]
        self.demand = -surplus[self.receivers]
        self._build()

    def _build(self) -> None:
        n_nodes, n_send = self.topology.nodes, len(self.senders)
        source, sink = 0, 1
        sender = 2 + np.arange(n_send)
        hub = 2 + n_send + np.arange(n_nodes)
        bucket = 2 + n_send + n_nodes + np.arange(n_nodes)
        exchange = 2 + n_send + 2 * n_nodes  # every node's hub reaches every bucket through it
        node_demand = np.bincount(self.nodes[self.receivers], self.demand, minlength=n_nodes)
        tails = [np.full(n_send, source), sender, sender, hub, np.full(n_nodes, exchange), bucket]
        heads = [sender, bucket[self.nodes[self.senders]], hub[self.nodes[self.senders]]]
        heads += [np.full(n_nodes, exchange), bucket, np.full(n_nodes, sink)]
        caps = [self.supply, self.supply, self.supply, np.full(2 * n_nodes, UNBOUNDED)]
        caps.append(node_demand.astype(np.int64))
        self.flow = max_flow_library().SimpleMaxFlow()
        arcs = self.flow.add_arcs_with_capacity(
            np.concatenate(tails).astype(np.int32),
            np.concatenate(heads).astype(np.int32),
            np.concatenate(caps).astype(np.int64),
        )
        self.intra_arcs = arcs[n_send : 2 * n_send]
        self.inter_arcs = arcs[2 * n_send : 3 * n_send]
        self.arrival_arcs = arcs[3 * n_send + n_nodes : 3 * n_send + 2 * n_nodes]

    def feasible(self, u: float) -> bool:
        """Can every surplus move with at most floor(u - a_i) tokens off-node per sender?"""
        caps = np.minimum(self._allowance(u), self.supply)
        if (caps < 0).any():
            return False
        self.flow.set_arcs_capacity(self.inter_arcs, caps.astype(np.int64))
        status = self.flow.solve(0, 1)
        if status != self.flow.OPTIMAL:
            raise PlacementError(f"remap max-flow failed with status {status}")
        return self.flow.optimal_flow() == int(self.supply.sum())

    def _allowance(self, u: float) -> np.ndarray:
        return np.floor(u - self.offsets + 1e-9)

    def solve(self) -> tuple[tuple[tuple[int, int, int], ...], float]:
        if not len(self.senders):
            return (), 0.0
        if self.inter - self.intra <= 1e-12 * self.inter:  # one link speed: any flow is optimal
            self.offsets = np.zeros(len(self.senders))
            self.feasible(float(self.supply.max()))
            return self._transfers()
        self.offsets = self.intra * self.supply / (self.inter - self.intra)
        lo, hi = float(self.offsets.max()), float((self.offsets + self.supply).max())
        if not self.feasible(lo):
            self.feasible(self._least_feasible(lo, hi))
        return self._transfers()

    def _least_feasible(self, lo: float, hi: float) -> float:
        """The least bound in (lo, hi] that is feasible (lo is not, hi is)."""
        while (self._allowance(hi) - self._allowance(lo)).sum() > 4 * len(self.senders):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if self.feasible(mid) else (mid, hi)
        values = set()
        for a, first, last in zip(
            self.offsets, self._allowance(lo) + 1, self._allowance(hi), strict=True
        ):
            values.update(float(a + k) for k in range(int(first), int(last) + 1))
        candidates = sorted(v for v in values if lo < v <= hi + 1e-9) or [hi]
        left, right = 0, len(candidates) - 1
        while left < right:
            mid = (left + right) // 2
            left, right = (left, mid) if self.feasible(candidates[mid]) else (mid + 1, right)
        return candidates[left]

    def _transfers(self) -> tuple[tuple[tuple[int, int, int], ...], float]:
        intra = np.asarray(self.flow.flows(self.intra_arcs))
        inter = np.asarray(self.flow.flows(self.inter_arcs))
        arrived = np.asarray(self.flow.flows(self.arrival_arcs))
        by_node: dict[int, list[int]] = {}
        for i, rank in enumerate(self.senders.tolist()):
            by_node.setdefault(int(self.nodes[rank]), []).append(i)
        left = _keep_home(inter, intra, arrived, by_node)
        incoming: dict[int, list[tuple[int, int]]] = {}
        for i, rank in enumerate(self.senders.tolist()):
            if intra[i]:
                incoming.setdefault(int(self.nodes[rank]), []).append((rank, int(intra[i])))
        # after `_keep_home` a node either sends off-node or receives: none meets itself
        sending = [(node, int(left[members].sum())) for node, members in sorted(by_node.items())]
        arrivals = [[node, int(n)] for node, n in enumerate(arrived.tolist()) if n > 0]
        for src_node, dst_node, amount in _match(sending, arrivals):
            pieces = incoming.setdefault(dst_node, [])
            pieces += _take_inter(self.senders, by_node[src_node], left, amount)
        wanting: dict[int, list[list[int]]] = {}  # per node, its receivers in rank order
        for rank, need in zip(self.receivers.tolist(), self.demand.tolist(), strict=True):
            wanting.setdefault(int(self.nodes[rank]), []).append([rank, need])
        out = []
        for node, pieces in incoming.items():
            out += _match(sorted(pieces), wanting[node])
        cost = self.intra * self.supply + (self.inter - self.intra) * inter
        return tuple(sorted(out)), float(cost.max())


def _keep_home(inter, intra, arrived, by_node) -> np.ndarray:
    """Off-node flow that the exchange node brought back to its own node is an
    intra-node transfer: moves it (in place) from `inter` to `intra` and from
    `arrived`; returns a copy of the senders' off-node tokens still to assign."""
    for node, members in by_node.items():
        back = min(int(inter[members].sum()), int(arrived[node]))
        arrived[node] -= back
        for i in members:
            moved = min(back, int(inter[i]))
            inter[i] -= moved
            intra[i] += moved
            back -= moved
    return inter.copy()


def _match(supplies, demands: list[list[int]]) -> list[tuple[int, int, int]]:
    """(source, destination, amount): `supplies` ((source, amount), in order) poured
    into `demands` ([destination, amount], in order), each filled before the next."""
    out, k = [], 0
    for src, amount in supplies:
        while amount:
            dst, need = demands[k]
            take = min(need, amount)
            out.append((src, dst, take))
            amount -= take
            demands[k][1] -= take
            if demands[k][1] == 0:
                k += 1
    return out


def _take_inter(senders, members, inter, amount: int) -> list[tuple[int, int]]:
    """(sender, tokens) covering `amount` off-node tokens of one node's senders
    (`members`: their indices, in rank order)."""
    out = []
    for i in members:
        if amount == 0:
            break
        if inter[i] == 0:
            continue
        take = int(min(inter[i], amount))
        inter[i] -= take
        amount -= take
        out.append((int(senders[i]), take))
    return out
