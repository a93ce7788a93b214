"""Remapping layer: the transfer solver is optimal and balanced; the layouts round-trip."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ortools.linear_solver import pywraplp

from ray_zep.config import load_config
from ray_zep.errors import PlacementError
from ray_zep.remap.solver import balanced_counts, solve_remap, token_costs
from ray_zep.topology import build_topology

TOKEN_BYTES = 1024


def _topology(nodes: int, gpus: int, preset: str = "virtual"):
    overrides = [f"topology.preset={preset}", f"topology.nodes={nodes}"]
    if preset == "virtual":
        overrides.append(f"topology.gpus_per_node={gpus}")
    return build_topology(load_config(None, overrides).topology)


def _cost_matrix(topo) -> np.ndarray:
    """T in units of the intra-node cost (solvers' tolerances are absolute)."""
    intra, inter = token_costs(topo, TOKEN_BYTES)
    d = topo.world_size
    t = np.full((d, d), inter / intra)
    for i, j in itertools.product(range(d), repeat=2):
        if topo.node_of(i) == topo.node_of(j):
            t[i, j] = 0.0 if i == j else 1.0
    return t


def _scaled_cost(plan, topo) -> float:
    return plan.max_rank_cost / token_costs(topo, TOKEN_BYTES)[0]


def _brute_force(counts, topo) -> float:
    """Least max sending cost over every integral transfer matrix (tiny instances)."""
    before = np.asarray(counts)
    surplus = before - balanced_counts(before)
    senders = [i for i in range(len(counts)) if surplus[i] > 0]
    receivers = [j for j in range(len(counts)) if surplus[j] < 0]
    t = _cost_matrix(topo)
    best = float("inf")

    def splits(total, parts):
        if parts == 1:
            yield (total,)
            return
        for first in range(total + 1):
            for rest in splits(total - first, parts - 1):
                yield (first, *rest)

    for rows in itertools.product(*(splits(int(surplus[i]), len(receivers)) for i in senders)):
        received = np.sum(rows, axis=0) if rows else np.zeros(0)
        if not np.array_equal(received, -surplus[receivers]):
            continue
        cost = max(
            (
                sum(t[i, j] * m for j, m in zip(receivers, row, strict=True))
                for i, row in zip(senders, rows, strict=True)
            ),
            default=0.0,
        )
        best = min(best, cost)
    return 0.0 if best == float("inf") else best


def _mip(counts, topo) -> float:
    """Eq. 2 as an integer program (SCIP), as a second, independent optimum."""
    before = np.asarray(counts)
    surplus = before - balanced_counts(before)
    d, t = len(counts), _cost_matrix(topo)
    solver = pywraplp.Solver.CreateSolver("SCIP")
    send = [i for i in range(d) if surplus[i] > 0]
    recv = [j for j in range(d) if surplus[j] < 0]
    m = {(i, j): solver.IntVar(0, int(surplus[i]), f"m{i}_{j}") for i in send for j in recv}
    z = solver.NumVar(0, solver.infinity(), "z")
    for i in send:
        solver.Add(sum(m[i, j] for j in recv) == int(surplus[i]))
        solver.Add(sum(float(t[i, j]) * m[i, j] for j in recv) <= z)
    for j in recv:
        solver.Add(sum(m[i, j] for i in send) == int(-surplus[j]))
    solver.Minimize(z)
    assert solver.Solve() == pywraplp.Solver.OPTIMAL
    return z.solution_value()


def _check_plan(plan, counts) -> None:
    before = np.asarray(counts)
    after = before.copy()
    mean = before.sum() / len(before)
    for src, dst, n in plan.transfers:
        assert n > 0 and src != dst
        after[src] -= n
        after[dst] += n
    assert after.tolist() == list(plan.counts_after)
    assert set(after.tolist()) <= {int(np.floor(mean)), int(np.ceil(mean))}
    senders = {s for s, _, _ in plan.transfers}
    receivers = {d for _, d, _ in plan.transfers}
    assert all(before[s] > after[s] for s in senders), "only surplus ranks send"
    assert not senders & receivers


@pytest.mark.parametrize("seed", range(12))
def test_solver_matches_brute_force_on_small_instances(seed: int) -> None:
    rng = np.random.default_rng(seed)
    topo = _topology(2, 2)
    counts = rng.integers(0, 7, size=4)
    plan = solve_remap(counts, topo, TOKEN_BYTES)
    _check_plan(plan, counts)
    assert _scaled_cost(plan, topo) == pytest.approx(_brute_force(counts, topo), rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("nodes,gpus", [(2, 4), (3, 4), (4, 8)])
def test_solver_matches_an_integer_program(seed: int, nodes: int, gpus: int) -> None:
    rng = np.random.default_rng(seed)
    topo = _topology(nodes, gpus)
    counts = rng.integers(0, 300, size=nodes * gpus)
    plan = solve_remap(counts, topo, TOKEN_BYTES)
    _check_plan(plan, counts)
    assert _scaled_cost(plan, topo) == pytest.approx(_mip(counts, topo), rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5000), min_size=8, max_size=8))
def test_every_rank_ends_balanced(counts: list[int]) -> None:
    plan = solve_remap(counts, _topology(2, 4), TOKEN_BYTES)
    _check_plan(plan, counts)


def test_balanced_counts_give_the_extra_tokens_to_the_fullest_ranks() -> None:
    assert balanced_counts(np.array([5, 0, 3, 1])).tolist() == [3, 2, 2, 2]
    assert balanced_counts(np.array([1, 4, 4, 0])).tolist() == [2, 3, 2, 2]
    assert balanced_counts(np.array([2, 2])).tolist() == [2, 2]


def test_bad_counts_name_the_problem() -> None:
    with pytest.raises(PlacementError, match="4 non-negative token counts"):
        solve_remap([1, 2, 3], _topology(2, 2), TOKEN_BYTES)
    with pytest.raises(PlacementError, match="non-negative"):
        solve_remap([1, -2, 3, 0], _topology(2, 2), TOKEN_BYTES)


def test_a_ranks_remap_messages_pay_one_latency_as_one_batch() -> None:
    """The remapping layer's estimate of one exchange: a rank sending one token to each of
    three ranks of another node posts the three as one batch, so it waits one latency
    beside its bytes, not three (as the simulator plays such a batch)."""
    from ray_zep.remap.policy import _exchange_seconds
    from ray_zep.remap.solver import RemapPlan

    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=2"])
    topology = build_topology(config.topology)
    token_bytes = 4096
    _, inter = token_costs(topology, token_bytes)
    remap = RemapPlan((4, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0),
                      (1, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 0, 0, 0, 0),
                      ((0, 9, 1), (0, 10, 1), (0, 11, 1)), 0.0, 0.0)  # fmt: skip
    seconds = _exchange_seconds(remap, topology, token_bytes)
    assert seconds == pytest.approx(topology.inter_node_latency + 3 * inter)
