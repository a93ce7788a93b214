"""MoE models under expert parallelism train like one process.

`single` routes the whole global batch in one process; `dp`+EP and
`zeppelin`+EP route each rank's tokens and send them to experts on other
ranks. The runs are dropless (`model.moe.capacity_factor=0`): with a capacity,
which choices drop depends on the routing group (a rank's tokens, as in
GShard), so only dropless routing can equal one process. The balance loss is
the whole batch's in every case (its counts are all-reduced).

Tolerance (fp32 on CPU): as in test_train_dist, partial sums in another order
(~1e-7 on gradients); after AdamW steps parameters agree to ~1e-6.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.procs import run_ranks
from tests.helpers.training import (
    NEEDS_EXPERT_MESH,
    SMALL_RUN,
    first_gradients,
    gradients_of,
    train_rank,
    train_rank_each,
)

pytestmark = pytest.mark.dist

REL_TOL = 1e-5
MOE_RUN = [
    *SMALL_RUN,
    "model.preset=tiny_moe",
    "model.n_layers=2",
    "model.moe.capacity_factor=0",
    "model.moe.aux_loss_coef=0.1",
    "topology.nodes=2",
    "topology.gpus_per_node=2",
]
EXPERTS = tuple(f"feed_forward.experts.{w}" for w in ("w1", "w3", "w2"))


def _whole_experts(per_rank: list[dict[str, torch.Tensor]], ep: int) -> dict[str, torch.Tensor]:
    """Rank 0's tensors with each split expert tensor put back together from its EP group."""
    whole = dict(per_rank[0])
    for name in whole:
        if name.endswith(EXPERTS):
            whole[name] = torch.cat([per_rank[r][name] for r in range(ep)])
    return whole


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want)
    for name, ref in want.items():
        diff = (got[name] - ref).abs()
        rel = float(diff.norm() / ref.norm().clamp_min(1e-30))
        assert rel <= REL_TOL, (
            f"{what} of {name}: relative error {rel:.2e}, max abs {float(diff.max()):.2e}, "
            f"mean abs {float(diff.mean()):.2e}"
        )


def _gradients_each(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    grads = []
    for overrides in runs:
        trainer = first_gradients(rank, overrides)
        assert trainer.model.moe_layers(), "the model must have MoE blocks"
        grads.append(gradients_of(trainer))
    return grads


GRADIENT_CASES = [("whole", 2), ("whole", 4), ("zeppelin", 2)]


def test_expert_parallel_gradients_match_single() -> None:
    single = run_ranks(_gradients_each, 1, [[*MOE_RUN, "parallel.sequence=single"]])[0][0]
    runs = [[*MOE_RUN, f"parallel.sequence={s}", f"parallel.ep={ep}"] for s, ep in GRADIENT_CASES]
    per_rank = run_ranks(_gradients_each, 4, runs)
    for index, (strategy, ep) in enumerate(GRADIENT_CASES):
        split = [grads[index] for grads in per_rank]
        _assert_close(_whole_experts(split, ep), single, f"{strategy} ep={ep} gradient")
        local = split[1]["layers.1.feed_forward.experts.w1"].shape[0]
        assert local == 4 // ep, "each rank must hold only its experts"


RUNS = {
    "dp_ep2": ["parallel.sequence=whole", "parallel.ep=2"],
    "dp_ep4_1a1m": [
        "parallel.sequence=whole",
        "parallel.ep=4",
        "parallel.moe_pipeline=1a1m",
        "parallel.moe_overlap_degree=4",
    ],
    "zeppelin_ep4_remap_moe_only": [
        "parallel.sequence=zeppelin",
        "parallel.ep=4",
        "parallel.remap=true",
        "parallel.remap_policy=always",
        "parallel.moe_pipeline=moe_only",
        "parallel.moe_overlap_degree=2",
    ],
}


def test_moe_trains_like_single(tmp_path: Path) -> None:
    """Every expert-parallel run of RUNS against one process (one spawn for all)."""
    base = [*MOE_RUN, "train.steps=3"]
    single = run_ranks(
        train_rank, 1, [*base, "parallel.sequence=single", f"train.out_dir={tmp_path / 's'}"]
    )[0]
    runs = [[*base, *extra, f"train.out_dir={tmp_path / name}"] for name, extra in RUNS.items()]
    per_rank = run_ranks(train_rank_each, 4, runs)
    for index, (name, extra) in enumerate(RUNS.items()):
        split = [results[index] for results in per_rank]
        for step, loss in single["losses"].items():
            got = split[0]["losses"][step]
            assert got == pytest.approx(loss, rel=REL_TOL), f"{name}: loss of step {step}"
        ep = int(next(o for o in extra if o.startswith("parallel.ep=")).split("=")[1])
        whole = _whole_experts([r["params"] for r in split], ep)
        _assert_close(whole, single["params"], f"{name} parameter")


def test_expert_parallel_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    base = [*MOE_RUN, "parallel.sequence=whole", "parallel.ep=2", "train.checkpoint_every=0"]
    runs = [
        [*base, "train.steps=4", f"train.out_dir={tmp_path / 'a'}"],
        [*base, "train.steps=2", f"train.out_dir={tmp_path / 'b'}"],
        [*base, "train.steps=4", f"train.out_dir={tmp_path / 'b'}"],
    ]
    per_rank = run_ranks(train_rank_each, 4, runs)
    assert per_rank[0][2]["events"][0] == {"event": "start", "step": 2}
    for rank, (full, _, second) in enumerate(per_rank):
        for name, value in full["params"].items():
            assert torch.equal(second["params"][name], value), f"rank {rank}: {name} differs"


COMPOSED = {
    "whole+replicated+1a1m": ["parallel.moe_pipeline=1a1m"],
    "whole+fsdp+1a1m": ["parallel.weights=fsdp", "parallel.moe_pipeline=1a1m"],
    "zeppelin+replicated": ["parallel.sequence=zeppelin"],
    "zeppelin+fsdp+1a1m": [
        "parallel.sequence=zeppelin",
        "parallel.weights=fsdp",
        "parallel.moe_pipeline=1a1m",  # attention spans ranks: the block overlaps MoE only
    ],
}
"""EP 2 with every sequence placement family and weights sharding (dropless)."""


@NEEDS_EXPERT_MESH
@pytest.mark.parametrize(
    "nodes,gpus", [(2, 2), pytest.param(2, 4, marks=pytest.mark.slow)], ids=["2x2", "2x4"]
)
def test_expert_parallelism_composes_with_placement_and_sharding(
    nodes: int, gpus: int, tmp_path: Path
) -> None:
    base = [
        *MOE_RUN,
        f"topology.nodes={nodes}",
        f"topology.gpus_per_node={gpus}",
        "train.steps=2",
        "train.save_last=false",  # the trainers' own parameters are compared
        "parallel.ep=2",
        "parallel.moe_overlap_degree=2",
    ]
    budget = ["data.packing=budget"]
    singles = run_ranks(
        train_rank_each,
        1,
        [
            [*base, *packing, "parallel.sequence=single", "parallel.ep=1", f"train.out_dir={out}"]
            for packing, out in (([], tmp_path / "s"), (budget, tmp_path / "sb"))
        ],
    )[0]
    runs = [
        [*base, *extra, *(budget * ("zeppelin" in name)), f"train.out_dir={tmp_path / name}"]
        for name, extra in COMPOSED.items()
    ]
    per_rank = run_ranks(train_rank_each, nodes * gpus, runs)
    for index, name in enumerate(COMPOSED):
        single = singles[1] if "zeppelin" in name else singles[0]
        split = [results[index] for results in per_rank]
        assert split[0]["samples"] == single["samples"], f"{name} saw other batches"
        for step, loss in single["losses"].items():
            got = split[0]["losses"][step]
            assert got == pytest.approx(loss, rel=REL_TOL), f"{name}: loss of step {step}"
        _assert_close(_whole_experts([r["params"] for r in split], 2), single["params"], name)


CAPACITY_RUN = [*MOE_RUN, "model.moe.capacity_factor=0.5", "train.steps=2"]
"""Half the slots a balanced gate needs: every step drops choices."""
BUDGET = "data.packing=budget"
CAPACITY_CASES = {
    "whole+ep2": (["parallel.ep=2"], ["parallel.reference_layout=whole"]),
    "zeppelin+ep2+1a1m": (
        ["parallel.sequence=zeppelin", "parallel.ep=2", "parallel.moe_pipeline=1a1m", BUDGET],
        ["parallel.reference_layout=zeppelin", BUDGET],
    ),
    "zeppelin+remap+fsdp+ep2": (
        [*("parallel.sequence=zeppelin", "parallel.weights=fsdp", "parallel.ep=2", BUDGET),
         *("parallel.remap=true", "parallel.remap_policy=always")],
        ["parallel.reference_layout=zeppelin", BUDGET, "parallel.remap=true",
         "parallel.remap_policy=always"],
    ),
}  # fmt: skip
"""Runs that drop choices, each beside the reference that routes in its groups."""


@NEEDS_EXPERT_MESH
def test_capacity_drops_equal_a_reference_that_routes_like_the_run(tmp_path: Path) -> None:
    """A reference mirrors the run's routing groups (`parallel.reference_layout`); one that
    routes the whole batch as one group drops other choices, so it must differ."""
    single = ["parallel.sequence=single"]
    references = [
        [*CAPACITY_RUN, *single, *ref, f"train.out_dir={tmp_path / ('ref_' + name)}"]
        for name, (_, ref) in CAPACITY_CASES.items()
    ]
    one_group = [*CAPACITY_RUN, *single, f"train.out_dir={tmp_path / 'one_group'}"]
    singles = run_ranks(train_rank_each, 1, [*references, one_group])[0]
    runs = [
        [*CAPACITY_RUN, *run, f"train.out_dir={tmp_path / name}"]
        for name, (run, _) in CAPACITY_CASES.items()
    ]
    per_rank = run_ranks(train_rank_each, 4, runs)
    for index, name in enumerate(CAPACITY_CASES):
        reference, split = singles[index], [results[index] for results in per_rank]
        for step, loss in reference["losses"].items():
            got = split[0]["losses"][step]
            assert got == pytest.approx(loss, rel=REL_TOL), f"{name}: loss of step {step}"
        _assert_close(_whole_experts([r["params"] for r in split], 2), reference["params"], name)
    # the grouping must matter, or nothing drops: the expert weights trained by the
    # one-group reference differ from the run's far beyond the tolerance
    whole_run = _whole_experts([r[0]["params"] for r in per_rank], 2)
    one = singles[-1]["params"]
    errors = {n: float((whole_run[n] - w).norm() / w.norm()) for n, w in one.items()}
    assert max(errors.values()) > 100 * REL_TOL, errors
