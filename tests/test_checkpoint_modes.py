"""A checkpoint written under one weights mode resumes under another, and at another
number of ranks, to the same losses and parameters as a run that never stopped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.procs import run_ranks
from tests.helpers.training import SMALL_RUN, train_rank, train_rank_each

pytestmark = pytest.mark.dist

REL_TOL = 1e-5
BASE = [*SMALL_RUN, "topology.nodes=2", "topology.gpus_per_node=2", "train.checkpoint_every=0"]
SWITCHES = [
    ("replicated", "fsdp"),
    ("fsdp", "tawpipe"),
    ("tawpipe", "hsdp"),
    ("ring_relay", "replicated"),
]


def _whole(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Every rank's parameters in one dict (weight-passing ranks hold disjoint shards)."""
    merged: dict[str, torch.Tensor] = {}
    for rank in per_rank:
        merged.update(rank["params"])
    return merged


def _assert_same(got: dict, want: dict, losses: dict, want_losses: dict, what: str) -> None:
    for step in (3, 4):
        assert losses[step] == pytest.approx(want_losses[step], rel=REL_TOL), (what, step)
    assert set(got) == set(want), what
    for name, ref in want.items():
        rel = float((got[name] - ref).norm() / ref.norm().clamp_min(1e-30))
        assert rel <= REL_TOL, f"{what}: {name}: relative error {rel:.2e}"


def test_resume_under_another_weights_mode_and_rank_count(tmp_path: Path) -> None:
    runs = [[*BASE, "train.steps=4", f"train.out_dir={tmp_path / 'straight'}"]]
    for first, second in SWITCHES:
        out = f"train.out_dir={tmp_path / f'{first}-{second}'}"
        runs.append([*BASE, f"parallel.weights={first}", "train.steps=2", out])
        runs.append([*BASE, f"parallel.weights={second}", "train.steps=4", out])
    out = f"train.out_dir={tmp_path / 'four-to-one'}"
    runs.append([*BASE, "parallel.weights=fsdp", "train.steps=2", out])
    per_rank = run_ranks(train_rank_each, 4, runs)
    # four ranks' checkpoint, resumed by the single-process reference (same global batch)
    single = run_ranks(train_rank, 1, [*BASE, "parallel.sequence=single", "train.steps=4", out])
    straight = per_rank[0][0]
    want, want_losses = straight["params"], straight["losses"]
    for index, (first, second) in enumerate(SWITCHES):
        resumed = [rank[2 + 2 * index] for rank in per_rank]
        assert min(resumed[0]["losses"]) == 3, "the second run resumes after step 2"
        what = f"{first} -> {second}"
        _assert_same(_whole(resumed), want, resumed[0]["losses"], want_losses, what)
    _assert_same(single[0]["params"], want, single[0]["losses"], want_losses, "4 ranks -> 1")
