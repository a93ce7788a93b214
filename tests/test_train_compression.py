"""Training with `comm.compression` on equals training with it off.

The zipped gradient all-reduce sums in float32 in rank order; gloo's
all-reduce sums in its own order, so gradients differ by rounding only
(relative 1e-7 level); the issue's bound for paths whose reduction order
changes is 1e-6 on losses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.procs import run_ranks
from tests.helpers.training import SMALL_RUN, first_gradients, gradients_of, train_rank_each

pytestmark = pytest.mark.dist

TWO_BY_TWO = ["topology.nodes=2", "topology.gpus_per_node=2", "parallel.sequence=whole"]
MODES = ["off", "always", "auto"]


def _gradients_each(rank: int, world: int, runs: list[list[str]]) -> list[dict]:
    results = []
    for overrides in runs:
        trainer = first_gradients(rank, overrides)
        sizes = trainer.zipped.take_sizes() if trainer.zipped else None
        results.append({"grads": gradients_of(trainer), "sizes": sizes})
    return results


def test_zipped_gradient_sync_matches_the_plain_one():
    runs = [[*SMALL_RUN, *TWO_BY_TWO, f"comm.compression={mode}"] for mode in MODES]
    per_rank = run_ranks(_gradients_each, 4, runs)
    plain, *zipped_runs = (list(run) for run in zip(*per_rank, strict=True))
    assert plain[0]["sizes"] is None
    for mode, zipped in zip(MODES[1:], zipped_runs, strict=True):
        for rank in range(4):
            for name, ref in plain[rank]["grads"].items():
                got = zipped[rank]["grads"][name]
                rel = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                assert rel <= 1e-6, f"{mode}: rank {rank} {name}: max rel. difference {rel:.2e}"
                assert torch.equal(got, zipped[0]["grads"][name]), f"ranks disagree on {name}"
        sizes = zipped[0]["sizes"]
        assert sizes.raw_bytes > 0 and sizes.wire_bytes > 0, mode
        if mode == "always":  # fp32 gradients: only the exponent compresses (< 32/27)
            assert 1.0 < sizes.raw_bytes / sizes.wire_bytes < 32 / 27


KV_ONLY = ["comm.compression=always", "comm.compression_streams=[kv]"]
RING_STRATEGIES = {
    "te_cp": ["parallel.sequence=te_cp"],
    "usp": ["parallel.sequence=usp", "parallel.ulysses_degree=2"],
}


def test_compressed_training_equals_plain_training(tmp_path: Path):
    """One spawn trains every pair: gradients zipped (losses within 1e-6), and K/V and
    dK/dV zipped, which only move, so compressing them changes no bit of the run."""
    base = [*SMALL_RUN, *TWO_BY_TWO]
    pairs = {"gradients": (["train.steps=3"], ["train.steps=3", "comm.compression=always"])}
    for name, strategy in RING_STRATEGIES.items():
        pairs[name] = ([*strategy, "train.steps=2"], [*strategy, "train.steps=2", *KV_ONLY])
    runs = [
        [*base, *overrides, f"train.out_dir={tmp_path / name / side}"]
        for name, pair in pairs.items()
        for side, overrides in zip(("off", "on"), pair, strict=True)
    ]
    results = run_ranks(train_rank_each, 4, runs)[0]
    (off, on), *ring_pairs = (results[i : i + 2] for i in range(0, len(results), 2))

    assert sorted(on["losses"]) == [1, 2, 3]
    for step, loss in off["losses"].items():
        assert on["losses"][step] == pytest.approx(loss, rel=1e-6), f"loss of step {step}"

    for name, (off, on) in zip(RING_STRATEGIES, ring_pairs, strict=True):
        assert on["losses"] == off["losses"], name
        for key, value in off["params"].items():
            assert torch.equal(on["params"][key], value), f"{name}: {key} differs"
        steps = [e for e in on["events"] if e["event"] == "step"]
        assert all(
            e["compression"]["raw_bytes"] > e["compression"]["wire_bytes"] > 0 for e in steps
        ), name
        assert all(not e.get("compression") for e in off["events"] if e["event"] == "step")
