"""What Ulysses groups send back in backward: dQ/dK/dV in the compute dtype where every
K/V head has one member (`ray_zep.attention.ulysses.ulysses_gradient_dtype`), and the
simulator's messages of the same size."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ray_zep.parallel.axes import Placement
from ray_zep.partition.plan import (
    AttentionPlan,
    SeqPlacement,
    bounds_for_counts,
    local_placement,
)
from ray_zep.partition.work import ulysses_row_bytes
from ray_zep.routing.routes import Phase
from ray_zep.sim.graph_builder import GraphBuilder
from ray_zep.sim.step import simulate_plan
from tests.helpers.procs import run_ranks
from tests.test_narrow_usp import usp_cluster
from tests.test_strategies import _ring_all

GRADIENTS = "Q/K/V gradient"


@pytest.mark.dist
def test_ulysses_gradients_travel_in_bf16_and_arrive_the_same() -> None:
    """A 61-token sequence on four ranks in bfloat16, one position of U = 4 (1 x 4) or two of
    U = 2 (2 x 2): where each of 8 K/V heads, or of 2 over 2 members, has one member,
    dQ/dK/dV go back in bf16, and every rank's outputs and gradients equal those of the
    float32 wire bit for bit (each owner receives each value once and keeps it in bf16);
    with 2 K/V heads over 4 members (two members a head, whose dK/dV the owner sums) they
    go in float32."""
    shapes = [(1, 4, 8), (1, 4, 2), (2, 2, 2), (2, 2, 8)]
    cases = []
    for nodes, gpus, kv_heads in shapes:
        positions = 4 // gpus  # the 61-token sequence on all four ranks, U = gpus
        counts = [61 // positions] * (positions - 1) + [61 - 61 // positions * (positions - 1)]
        group = SeqPlacement(0, 61, (0, 1, 2, 3), bounds_for_counts(counts), ulysses=gpus)
        rest = [local_placement(1, 5, 0), local_placement(2, 3, 1), local_placement(3, 9, 2)]
        base = dict(strategy="zeppelin", routing=False, nodes=nodes, gpus=gpus, heads=8,
                    kv_heads=kv_heads, dim=4, lengths=[61, 5, 3, 9], dtype="bfloat16",
                    capacity=24, placements=[group, *rest])  # fmt: skip
        cases += [base, {**base, "ulysses_grads_in_float32": True}]
    results = run_ranks(_ring_all, 4, cases)
    for index, (_, gpus, kv_heads) in enumerate(shapes):
        shared = gpus > kv_heads
        for per_rank in results:
            ours, float32 = per_rank[2 * index], per_rank[2 * index + 1]
            assert float32["wires"][GRADIENTS] == "torch.float32"
            assert ours["wires"][GRADIENTS] == ("torch.float32" if shared else "torch.bfloat16")
            assert ours["wires"]["output gradient"] == "torch.bfloat16"
            for name in ("out", "dq", "dk", "dv"):
                assert torch.equal(ours[name], float32[name]), (gpus, kv_heads, name)


@pytest.mark.unit
@pytest.mark.parametrize("kv_heads,ratio", [(32, 1), (4, 2)])
def test_the_simulator_sends_what_the_engine_sends(kv_heads, ratio, monkeypatch) -> None:
    """A lone 7b USP group of 3 whole-node positions (U = 8), bf16: backward returns as many
    bytes of dQ/dK/dV as forward sent of Q/K/V where each of the 32 K/V heads has one
    member, twice as many (float32) where 4 K/V heads are shared by 8 members; all four
    all-to-alls together carry what the planner's work model charges
    (`ulysses_row_bytes`)."""
    topology, run, _ = usp_cluster(4)
    run = dataclasses.replace(run, shape=dataclasses.replace(run.shape, n_kv_heads=kv_heads))
    sent = {Phase.FORWARD: {}, Phase.BACKWARD: {}}
    part = GraphBuilder.rank_exchange

    def noted(self, rank, kind, nbytes, deps, name, *args, **kwargs):
        table = sent[self.phase]  # members hold equal rows: each part's bytes are its sends
        table[name] = table.get(name, 0) + nbytes
        return part(self, rank, kind, nbytes, deps, name, *args, **kwargs)

    monkeypatch.setattr(GraphBuilder, "rank_exchange", noted)
    n = 24_000
    group = SeqPlacement(0, n, tuple(range(24)), bounds_for_counts([n // 3] * 3), ulysses=8)
    simulate_plan(AttentionPlan(Placement.ZEPPELIN, topology, 10_240, (group,)), run, False, None)
    forward_in = sent[Phase.FORWARD]["Ulysses in"]
    assert forward_in > 0
    assert sent[Phase.BACKWARD]["Ulysses out"] == ratio * forward_in
    # the planner's work model charges the same bytes (`usp_member_seconds`)
    total = sum(table.get(name, 0) for table in sent.values()
                for name in ("Ulysses in", "Ulysses out"))  # fmt: skip
    assert total == pytest.approx(n * 7 / 8 * ulysses_row_bytes(run.shape, 8))
