"""Every parallel strategy trains like one process, and ring attention matches the reference.

Multi-process gloo tests. The batches hold sequences of length 1, odd lengths,
lengths below 2 x G, many tiny documents and one document longer than a node
holds, so every zone, empty zigzag chunks and fragments of one token occur.

Tolerances (fp32): attention outputs and gradients are merged from ring steps in
a different order than one kernel call sums them (~1e-6 absolute); training
compares parameters after AdamW steps at the project-wide 1e-5 relative error
(see test_train_dist for why AdamW amplifies rounding).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ray_zep.data.builder import write_token_parquet
from tests.helpers.attention import reference, ring_rank
from tests.helpers.procs import run_ranks
from tests.helpers.training import SMALL_RUN, max_relative_error, train_rank

pytestmark = pytest.mark.dist

STRATEGIES = ["zeppelin", "te_cp", "llama_cp", "hybrid_dp", "ulysses", "usp"]
ROUTED = ["zeppelin", "te_cp", "usp"]
"""Strategies whose plans have ring transfers between nodes (routing applies)."""
TOPOLOGIES = [(1, 4), (2, 2), (2, 4)]
HEADS = ["model.n_heads=8", "model.n_kv_heads=2"]
ATTENTION_TOL = 1e-5


def _ring_all(rank: int, world: int, cases: list[dict]) -> list[dict]:
    return [ring_rank(rank, world, case) for case in cases]


@pytest.mark.parametrize("nodes,gpus", TOPOLOGIES, ids=lambda v: str(v))
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
def test_ring_attention_matches_single_device(nodes: int, gpus: int, kv_heads: int) -> None:
    lengths = [1, 7, 3, 2 * gpus - 1, 2, 5 * gpus * 12 + 1, *[1, 2, 1, 3] * 4, 33]
    capacity = -(-sum(lengths) // (nodes * gpus)) + 4
    routed = [(s, True) for s in ROUTED] if nodes > 1 else []
    cases = [
        dict(
            strategy=s,
            routing=routing,
            nodes=nodes,
            gpus=gpus,
            heads=8,
            kv_heads=kv_heads,
            dim=4,
            lengths=lengths,
            capacity=capacity,
        )
        for s, routing in [*((s, False) for s in STRATEGIES), *routed]
    ]
    results = run_ranks(_ring_all, nodes * gpus, cases)
    q, k, v, _, out = reference(lengths, 8, kv_heads, 4, 0)
    for index, case in enumerate(cases):
        for rank, per_rank in enumerate(results):
            got = per_rank[index]
            rows = torch.as_tensor(got["rows"])
            n = len(rows)
            for name, value, ref in [
                ("out", got["out"], out),
                ("dq", got["dq"], q.grad),
                ("dk", got["dk"], k.grad),
                ("dv", got["dv"], v.grad),
            ]:
                diff = (value[:n] - ref[rows]).abs()
                where = f"{case['strategy']} routing={case['routing']} rank {rank} {name}"
                assert n == 0 or float(diff.max()) <= ATTENTION_TOL, (
                    f"{where}: max abs {float(diff.max()):.2e}, mean {float(diff.mean()):.2e}"
                )
                assert torch.count_nonzero(value[n:]) == 0, f"{where}: padding rows not zero"
            assert got["ops"] == got["expected_ops"], f"{case} rank {rank}"
        if case["routing"] and case["strategy"] == "te_cp":
            routed = sum(r[index]["ops"].get("routed", 0) for r in results)
            assert routed > 0, "te_cp crosses nodes: routing must act"


def _mixed_dataset(path: Path) -> Path:
    rng = np.random.default_rng(3)
    lengths = [1, 3, 5, 7, 300, *[1, 2, 3, 1] * 8, 63, 129, 77, 2, 1, 40, 9, 250, 11]
    docs = [rng.integers(0, 256, size=n, dtype=np.int32) for n in lengths]
    return write_token_parquet(docs, path).path


def _train_all(rank: int, world: int, base: list[str], out: str) -> dict:
    return {
        s: train_rank(rank, world, [*base, f"parallel.strategy={s}", f"train.out_dir={out}/{s}"])
        for s in STRATEGIES
    }


@pytest.mark.parametrize("nodes,gpus", TOPOLOGIES, ids=lambda v: str(v))
def test_every_strategy_trains_like_one_process(nodes: int, gpus: int, tmp_path: Path) -> None:
    data = _mixed_dataset(tmp_path / "mixed.parquet")
    base = [
        *SMALL_RUN,
        *HEADS,
        f"topology.nodes={nodes}",
        f"topology.gpus_per_node={gpus}",
        "train.tokens_per_rank=64",
        "train.steps=2",
        f"data.source={data}",
        "data.packing=budget",
        "data.shuffle=false",
    ]
    single = run_ranks(
        train_rank, 1, [*base, "parallel.strategy=single", f"train.out_dir={tmp_path}/single"]
    )[0]
    runs = run_ranks(_train_all, nodes * gpus, base, str(tmp_path))
    assert sorted(single["losses"]) == [1, 2]
    for strategy in STRATEGIES:
        run = runs[0][strategy]
        assert run["samples"] == single["samples"], f"{strategy} saw other batches"
        for step, loss in single["losses"].items():
            assert run["losses"][step] == pytest.approx(loss, rel=1e-5), f"{strategy} step {step}"
        err, name = max_relative_error(run["params"], single["params"])
        assert err <= 1e-5, f"{strategy}: parameter {name} relative error {err:.2e}"
