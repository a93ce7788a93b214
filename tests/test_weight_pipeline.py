"""Weight-passing pipelines (TawPipe, ring, FSDP-style) train like one process.

Every device trains its own sequences while the weight shards travel; after
five steps the losses and every parameter must equal `single` on the same
global batches. The layers are initialised differently from each other, so a
shard delivered to the wrong place shows. Tolerance as in test_train_dist
(fp32, sums in another order, AdamW steps): rel. 1e-5.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from ray_zep.errors import ConfigError
from ray_zep.parallel.axes import Passing
from ray_zep.pipeline.layout import WeightLayout, cut_shards
from tests.helpers.procs import run_ranks
from tests.helpers.training import SMALL_RUN, checkpoint_params, train_rank, train_rank_each

REL_TOL = 1e-5
PIPE_RUN = [*SMALL_RUN, "model.n_layers=6", "train.tokens_per_rank=128", "train.steps=3"]
"""Three steps, as the equality standard asks (losses and every parameter)."""
TOPOLOGIES = {"1x4": (1, 4), "2x2": (2, 2), "2x4": (2, 4)}


@pytest.mark.unit
def test_shards_are_contiguous_balanced_and_cover_every_unit() -> None:
    sizes = [100, 10, 10, 10, 10, 10, 10, 100]
    shards = cut_shards(sizes, 4)
    assert [u for r in shards for u in r] == list(range(8))
    assert all(len(r) >= 1 for r in shards)
    assert [sum(sizes[u] for u in r) for r in shards] == [100, 30, 30, 100]
    with pytest.raises(ConfigError, match=r"model\.n_layers"):
        cut_shards([1, 1, 1], 4)


@pytest.mark.unit
def test_tawpipe_interleaves_owners_over_groups_as_the_paper() -> None:
    layout = WeightLayout.build(Passing.GROUPED, [1] * 6, nodes=2, gpus_per_node=3)
    # P0:W0 P1:W2 P2:W4 in group 0, P3:W1 P4:W3 P5:W5 in group 1
    assert [layout.shard_of(d) for d in range(6)] == [0, 2, 4, 1, 3, 5]
    assert [layout.root(1, 0), layout.root(1, 1)] == [0, 3], "staging device: owner's local index"
    ring = WeightLayout.build(Passing.RING, [1] * 6, nodes=2, gpus_per_node=3)
    assert ring.owners == tuple(range(6)) and len(ring.groups) == 1


def _merged(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for rank in per_rank:
        assert not set(rank["params"]) & set(merged), "a parameter owned twice"
        merged.update(rank["params"])
    return merged


STRATEGY_RUNS = {
    "1x4": [("tawpipe",), ("weipipe",)],
    "2x2": [("tawpipe",), ("weipipe",), ("tawpipe", "parallel.shard_recompute=false")],
    "2x4": [("tawpipe",), ("weipipe",)],
}
"""Weight-passing modes with whole sequences (FSDP2 is tested with every placement in
test_strategies)."""


@pytest.mark.dist
@pytest.mark.parametrize(
    "topology", [pytest.param(t, marks=[pytest.mark.slow] * (t == "2x4")) for t in TOPOLOGIES]
)
def test_weight_passing_trains_like_single(topology: str, tmp_path: Path) -> None:
    nodes, gpus = TOPOLOGIES[topology]
    base = [*PIPE_RUN, f"topology.nodes={nodes}", f"topology.gpus_per_node={gpus}"]
    single = run_ranks(
        train_rank, 1, [*base, "parallel.sequence=single", f"train.out_dir={tmp_path / 's'}"]
    )[0]
    layers = [single["params"][f"layers.{i}.attention.wq.weight"] for i in range(6)]
    assert all(not torch.equal(a, b) for a, b in itertools.pairwise(layers))
    configs = [
        [*base, f"parallel.weights={strategy}", *extra, f"train.out_dir={tmp_path / str(i)}"]
        for i, (strategy, *extra) in enumerate(STRATEGY_RUNS[topology])
    ]
    per_rank = run_ranks(train_rank_each, nodes * gpus, configs)
    for index, case in enumerate(STRATEGY_RUNS[topology]):
        _assert_like_single([rank[index] for rank in per_rank], single, " ".join(case))


def _assert_like_single(runs: list[dict], single: dict, case: str) -> None:
    for step, loss in single["losses"].items():
        got = runs[0]["losses"][step]
        assert got == pytest.approx(loss, rel=REL_TOL), f"{case}: loss of step {step}"
    merged = _merged(runs)
    assert set(merged) == set(single["params"]), case
    for name, ref in single["params"].items():
        rel = float((merged[name] - ref).norm() / ref.norm().clamp_min(1e-30))
        assert rel <= REL_TOL, f"{case}: {name}: relative error {rel:.2e}"
    for run in runs:
        ledger = run["weight_ledger"]
        # own shard, one borrowed shard at a time, one staging buffer
        assert ledger.peak_bytes <= ledger.own_bytes + 2 * ledger.largest_shard_bytes, case
        assert ledger.peak_bytes > ledger.own_bytes + ledger.staging_bytes, case


@pytest.mark.dist
def test_tawpipe_checkpoint_holds_the_whole_model_and_resumes_exactly(tmp_path: Path) -> None:
    base = [*PIPE_RUN, "topology.nodes=2", "topology.gpus_per_node=2"]
    base += ["parallel.weights=tawpipe", "train.checkpoint_every=0"]
    full = run_ranks(train_rank, 4, [*base, "train.steps=4", f"train.out_dir={tmp_path / 'a'}"])
    run_ranks(train_rank, 4, [*base, "train.steps=2", f"train.out_dir={tmp_path / 'b'}"])
    second = run_ranks(train_rank, 4, [*base, "train.steps=4", f"train.out_dir={tmp_path / 'b'}"])
    assert second[0]["events"][0] == {"event": "start", "step": 2}
    merged, resumed = _merged(full), _merged(second)
    for name, value in merged.items():
        assert torch.equal(resumed[name], value), f"{name} differs after resume"
    stored = checkpoint_params(tmp_path / "a" / "checkpoints" / "step_00000004", base)
    assert set(stored) == set(merged)
    for name, value in merged.items():
        assert torch.equal(stored[name], value), f"checkpoint holds another {name}"
