"""USP head exchanges in pieces beside the projections (`ray_zep.attention.ulysses_chunks`):
the attention block's output and every gradient equal one device's, the pieces really
travel apart, and training with them is in `tests/test_strategies.py`'s matrix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_zep.attention.kernels import torch_varlen_attention
from ray_zep.attention.links import Links
from ray_zep.attention.rope import apply_rope, rope_tables
from ray_zep.attention.schedule import RankSchedule
from ray_zep.attention.ulysses_chunks import chunk_sizes, overlapped_attention
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.config import load_config
from ray_zep.data.synthetic import batch_lengths
from ray_zep.distributed import Comm
from ray_zep.errors import ConfigError
from ray_zep.parallel.axes import Placement
from ray_zep.partition import balance
from ray_zep.partition.level_trace import LevelOutcome
from ray_zep.partition.plan import AttentionPlan, SeqPlacement, bounds_for_counts, local_placement
from ray_zep.partition.work import WorkModel, exposed_exchange, ulysses_row_bytes
from ray_zep.sim.events import Lane
from ray_zep.sim.graph_builder import GraphBuilder
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel, simulate_plan
from ray_zep.step_plan import plan_step
from ray_zep.topology import LinkKind, build_topology
from tests.helpers.attention import KERNELS
from tests.helpers.procs import run_ranks
from tests.helpers.scenarios import zeppelin_case

LENGTHS = [61, 5, 3, 9]
DIM, HEAD_DIM = 16, 4


@pytest.mark.unit
def test_chunk_sizes_cover_the_rows_longest_first() -> None:
    assert chunk_sizes(10, 4) == [3, 3, 2, 2]
    assert chunk_sizes(2, 4) == [1, 1, 0, 0]
    assert chunk_sizes(0, 3) == [0, 0, 0]


def _weights(heads: int, kv_heads: int):
    g = torch.Generator().manual_seed(1)
    shapes = [(DIM, heads * HEAD_DIM), (DIM, kv_heads * HEAD_DIM), (DIM, kv_heads * HEAD_DIM),
              (heads * HEAD_DIM, DIM)]  # fmt: skip
    return [torch.randn(shape, generator=g) / 4 for shape in shapes]


def _block(weights, heads: int, kv_heads: int):
    """(inputs, output) of an attention block with these projection weights."""
    wq, wk, wv, wo = weights

    def inputs(x_TD, rope):
        rows = x_TD.shape[0]
        q = apply_rope((x_TD @ wq).view(rows, heads, HEAD_DIM), *rope)
        k = apply_rope((x_TD @ wk).view(rows, kv_heads, HEAD_DIM), *rope)
        return q, k, (x_TD @ wv).view(rows, kv_heads, HEAD_DIM)

    def output(out_THE):
        return out_THE.reshape(out_THE.shape[0], heads * HEAD_DIM) @ wo

    return inputs, output


def _data(heads: int, kv_heads: int):
    g = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    x = torch.randn(total, DIM, generator=g)
    upstream = torch.randn(total, DIM, generator=g)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    return x, upstream, rope_tables(positions, HEAD_DIM, 10000.0), _weights(heads, kv_heads)


def _reference(heads: int, kv_heads: int):
    """One device: the block's output and the gradients of x and of every weight."""
    x, upstream, rope, weights = _data(heads, kv_heads)
    x.requires_grad_(True)
    for w in weights:
        w.requires_grad_(True)
    inputs, output = _block(weights, heads, kv_heads)
    out, _ = torch_varlen_attention(*inputs(x, rope), PackedSeqs.from_lengths(LENGTHS), causal=True)
    y = output(out)
    (y * upstream).sum().backward()
    return y.detach(), x.grad, [w.grad for w in weights]


def _plan(topology) -> AttentionPlan:
    """The long sequence on 3 positions of 2 GPUs starting mid-node (2 x 4), the rest
    whole; or on 2 positions of 2 GPUs (2 x 2)."""
    if topology.gpus_per_node == 4:
        group = SeqPlacement(0, 61, tuple(range(2, 8)), bounds_for_counts([20, 21, 20]), 2)
        rest = [local_placement(1, 5, 0), local_placement(2, 3, 1), local_placement(3, 9, 0)]
    else:
        group = SeqPlacement(0, 61, (0, 1, 2, 3), bounds_for_counts([30, 31]), 2)
        rest = [local_placement(1, 5, 0), local_placement(2, 3, 1), local_placement(3, 9, 2)]
    plan = AttentionPlan(Placement.ZEPPELIN, topology, 64, (group, *rest))
    plan.validate()
    return plan


def _rank(rank: int, world: int, case: dict) -> dict:
    heads, kv_heads = case["heads"], case["kv_heads"]
    config = load_config(None, [f"topology.nodes={case['nodes']}",
                                f"topology.gpus_per_node={case['gpus']}"])  # fmt: skip
    topology = build_topology(config.topology)
    plan = _plan(topology)
    starts = np.concatenate([[0], np.cumsum(LENGTHS)])
    rows = np.concatenate(
        [np.arange(f.start, f.end) + starts[f.seq] for f in plan.layout(rank)] or [[]]
    ).astype(np.int64)
    index = torch.as_tensor(rows)
    x, upstream, rope, weights = _data(heads, kv_heads)
    x = x[index].requires_grad_(True)
    for w in weights:
        w.requires_grad_(True)
    schedule = RankSchedule.build(plan, rank)
    links = Links(Comm.create(topology, topology.world_size, 60.0))
    inputs, output = _block(weights, heads, kv_heads)
    rope = tuple(t[index] for t in rope)
    y = overlapped_attention(x, rope, inputs, output, schedule, links, KERNELS, case["chunks"])
    (y * upstream[index]).sum().backward()
    usp = any(item.item.ulysses > 1 for item in schedule.items)
    return {"rows": rows, "y": y.detach(), "dx": x.grad, "dw": [w.grad for w in weights],
            "p2p": schedule.ops["p2p"], "usp": usp}  # fmt: skip


def _assert_close(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    """fp32: relative error (norm of the difference over the norm) at most 1e-5."""
    if want.numel():
        err = float((got - want).norm() / want.norm().clamp_min(1e-30))
        assert err <= 1e-5, f"{where}: relative error {err:.2e}"


def _all(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [_rank(rank, world, case) for case in cases]


@pytest.mark.dist
@pytest.mark.parametrize("nodes,gpus", [(2, 2), (2, 4)], ids=["2x2", "2x4"])
def test_pieces_beside_the_projections_match_one_device(nodes: int, gpus: int) -> None:
    """Multi-head and grouped-query (K/V heads shared by members), 1, 3 and 16 pieces
    (more pieces than a member has rows: empty ones): every rank's rows of the output
    equal one device's, and the weights' gradients summed over ranks; a rank of the USP
    group posts more messages with more pieces."""
    cases = [dict(nodes=nodes, gpus=gpus, heads=8, kv_heads=kv, chunks=c)
             for kv in (8, 1) for c in (1, 3, 16)]  # fmt: skip
    results = run_ranks(_all, nodes * gpus, cases)
    for index, case in enumerate(cases):
        y, dx, dw = _reference(case["heads"], case["kv_heads"])
        got = [r[index] for r in results]
        for rank, r in enumerate(got):
            rows = torch.as_tensor(r["rows"])
            _assert_close(r["y"], y[rows], f"{case} rank {rank} output")
            _assert_close(r["dx"], dx[rows], f"{case} rank {rank} dx")
        for n, want in enumerate(dw):
            _assert_close(sum(r["dw"][n] for r in got), want, f"{case} weight {n}")
    for first in (0, 3):  # the cases of one K/V head count: 1, 3, 16 pieces
        member = next(r for r in results if r[first]["usp"])
        counts = [member[first + n]["p2p"] for n in range(3)]
        assert counts[0] < counts[1] <= counts[2], counts


def _usp_run(pieces: int, nodes: int = 4):
    """Cluster A's `nodes` nodes, 7b, zeppelin, head exchanges in `pieces`: topology and
    run."""
    config = load_config(None, ["topology.preset=cluster_a", f"topology.nodes={nodes}",
                                "model.preset=7b", "train.tokens_per_rank=10240",
                                "parallel.weights=fsdp", "parallel.sequence=zeppelin",
                                f"parallel.ulysses_chunks={pieces}"])  # fmt: skip
    topology = build_topology(config.topology)
    return topology, RunModel.create(config, Hardware.preset(topology))


@pytest.mark.unit
def test_the_simulator_plays_the_pieces_beside_the_projections(monkeypatch) -> None:
    """A lone 7b USP group of 3 whole-node positions (U = 8): in 4 pieces, every Ulysses
    exchange moves as many bytes as whole, in 4 times the parts; the step is shorter, by
    less than the exchanges take whole."""
    counted = {}
    part = GraphBuilder.rank_exchange

    def noted(self, rank, kind, nbytes, deps, name, *args, **kwargs):
        if name.startswith("Ulysses"):
            key = (self.setup.ulysses_chunks, self.phase, name)
            count, total = counted.get(key, (0, 0.0))
            counted[key] = (count + 1, total + nbytes)
        return part(self, rank, kind, nbytes, deps, name, *args, **kwargs)

    monkeypatch.setattr(GraphBuilder, "rank_exchange", noted)
    n = 24_000
    steps = {}
    for pieces in (1, 4):
        topology, run = _usp_run(pieces)
        group = SeqPlacement(0, n, tuple(range(24)), bounds_for_counts([n // 3] * 3), ulysses=8)
        plan = AttentionPlan(Placement.ZEPPELIN, topology, 10_240, (group,))
        steps[pieces] = simulate_plan(plan, run, False, None)
    assert len(counted) == 8
    for (pieces, phase, name), (count, total) in counted.items():
        if pieces == 4:
            whole_count, whole_total = counted[1, phase, name]
            assert count == 4 * whole_count, (phase, name)
            assert total == pytest.approx(whole_total), (phase, name)
    whole, split = steps[1], steps[4]
    assert split.step_seconds < whole.step_seconds
    # what pieces hide is at most the exchanges' own time: a member's messages, every layer
    exchanges = [t for timeline in (whole.forward, whole.backward) for t in timeline.graph.tasks
                 if t.name.startswith("Ulysses") and t.rank == 0]  # fmt: skip
    hidden = sum(t.duration for t in exchanges) * run.shape.n_layers
    assert whole.step_seconds - split.step_seconds < hidden


@pytest.mark.unit
def test_pieces_posted_together_travel_one_after_another() -> None:
    """A lone 7b USP group of 2 positions of 2 whole nodes each (U = 16, its exchanges
    crossing the NICs), 4 pieces: after the ring a member posts every piece's output
    (forward) or dQ/dK/dV (backward) at once, and NCCL runs them in order, so each of its
    parts moves only after the piece before it, at the links' whole pace: the first
    piece arrives by a quarter of the way, and the projection of the first piece
    starts before the last piece has arrived."""
    n = 64_000
    topology, run = _usp_run(4, nodes=4)
    group = SeqPlacement(0, n, tuple(range(32)), bounds_for_counts([n // 2] * 2), ulysses=16)
    plan = AttentionPlan(Placement.ZEPPELIN, topology, 40_960, (group,))
    step = simulate_plan(plan, run, False, None)
    for timeline, projection in ((step.forward, "output projection"),
                                 (step.backward, "QKV projection")):  # fmt: skip
        tasks = timeline.graph.tasks
        parts = [i for i, t in enumerate(tasks) if t.rank == 0 and t.name == "Ulysses out"
                 and t.lane is Lane.INTER_NODE]  # fmt: skip
        assert len(parts) == 4
        start, end = timeline.start[parts], timeline.end[parts]
        assert np.all(start[1:] >= end[:-1] - 1e-12), (start, end)
        assert end[0] - start[0] < (end[-1] - start[0]) / 2
        first = min(timeline.start[i] for i, t in enumerate(tasks)
                    if t.rank == 0 and t.name == projection and t.duration > 0
                    and timeline.start[i] >= start[0])  # fmt: skip
        assert first < end[-1]


@pytest.mark.unit
def test_the_work_model_hides_what_the_projections_cover_but_a_piece() -> None:
    """`exposed_exchange`: one piece hides nothing; an exchange shorter than the
    projections keeps one piece's share exposed; a longer one its excess besides; a USP
    group's member work drops by no more than its all-to-alls take whole."""
    assert exposed_exchange(3.0, 5.0, 2.0, 1) == (3.0, 5.0)
    forward, backward = exposed_exchange(1.0, 1.0, 2.0, 4)  # backward: 2 x 2 s of projections
    assert (forward, backward) == pytest.approx((0.25, 0.25))
    forward, backward = exposed_exchange(3.0, 5.0, 2.0, 4)
    assert (forward, backward) == pytest.approx((3.0 - 1.5, 5.0 - 3.0))
    topology, run = _usp_run(1)
    n = np.asarray([24_000.0, 96_000.0])
    models = [WorkModel.create(run.shape, topology, run.hardware.rates, ulysses_pieces=pieces)
              for pieces in (1, 4)]  # fmt: skip
    whole, split = (m.usp_member_seconds(n, 3, 8) for m in models)
    assert np.all(split < whole)
    member = n / 24
    every = member * ulysses_row_bytes(run.shape, 8) * 7 / 8 / models[0].hop(LinkKind.INTRA_NODE)[1]
    assert np.all(whole - split < every * run.shape.n_layers)


@pytest.mark.unit
def test_a_level_short_of_nodes_is_placed_again_with_the_exchanges_costed_whole(
    monkeypatch,
) -> None:
    """`bench scale`'s 7b prolong64k batch on 4,096 GPUs of cluster A (L = 10,240, no K/V
    room): with USP groups' exchanges costed in 4 pieces, levels 1.2 and 1.225 find no
    nodes for their groups and the work policy keeps 1.228x the mean rank's work; placed
    again with the exchanges costed whole, levels 1.2 and 1.175 place and the halvings under
    them keep 1.171875, every rank within L."""
    config, topology, shape = zeppelin_case(4096, "7b", 10240, "parallel.ulysses_chunks=4")
    lengths = batch_lengths("prolong64k", 4096 * 4096, 0)

    def levels() -> tuple[dict, object]:
        plan = plan_step(lengths, config, topology, shape).attention
        return {round(t.factor, 4): t.outcome for t in plan.levels}, plan

    tried, plan = levels()
    assert tried[1.2] is LevelOutcome.PLACED and tried[1.175] is LevelOutcome.PLACED
    assert tried[1.1719] is LevelOutcome.KEPT
    assert plan.rank_tokens().max() <= 10240
    monkeypatch.setattr(balance, "WHOLE_COST_RETRY", False)
    tried, _ = levels()
    assert tried[1.2] is LevelOutcome.NODES and tried[1.2281] is LevelOutcome.KEPT


@pytest.mark.unit
def test_fewer_than_one_piece_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.ulysses_chunks"):
        load_config(None, ["parallel.ulysses_chunks=0"])
