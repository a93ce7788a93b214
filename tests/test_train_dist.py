"""Data parallelism equals one process; resume equals no interruption; peers time out.

Multi-process gloo tests without Ray: each test spawns the ranks with
`tests.helpers.procs.run_ranks`.

Tolerance (fp32 on CPU): one process sums a weight's gradient over all tokens
in one matmul, dp sums per-rank partial matmuls, so the two differ by rounding
(~1e-7 relative on gradients). AdamW divides each element's update by that
element's gradient magnitude, which passes the larger relative rounding error
of nearly cancelling gradient elements into the parameters; with the default
warm-up the worst parameter error measured after 3 steps is ~1.2e-6.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ray_zep.config import load_config
from ray_zep.data.builder import write_token_parquet
from ray_zep.errors import CommError, TopologyError
from ray_zep.topology import build_topology
from ray_zep.train.ledger import ledger_path, read_ledger
from ray_zep.train.reductions import sum_over_ranks_
from ray_zep.train.setup import create_comm
from tests.helpers.procs import run_fresh_ranks, run_ranks
from tests.helpers.samples import assert_each_token_once_per_epoch
from tests.helpers.training import (
    SMALL_RUN,
    first_gradients,
    gradients_of,
    max_relative_error,
    train_rank,
)

pytestmark = pytest.mark.dist

REL_TOL = 1e-5
TWO_BY_TWO = ["topology.nodes=2", "topology.gpus_per_node=2"]


def test_dp_matches_single_on_2x2(tmp_path: Path) -> None:
    base = [*SMALL_RUN, *TWO_BY_TWO, "train.steps=3"]
    single = run_ranks(
        train_rank, 1, [*base, "parallel.sequence=single", f"train.out_dir={tmp_path / 'single'}"]
    )[0]
    dp = run_ranks(
        train_rank, 4, [*base, "parallel.sequence=whole", f"train.out_dir={tmp_path / 'dp'}"]
    )

    assert dp[0]["samples"] == single["samples"], "both strategies must see the same batches"
    assert sorted(single["losses"]) == [1, 2, 3]
    for step, loss in single["losses"].items():
        assert dp[0]["losses"][step] == pytest.approx(loss, rel=REL_TOL), f"loss of step {step}"
    err, name = max_relative_error(dp[0]["params"], single["params"])
    assert err <= REL_TOL, f"parameter {name}: relative error {err:.2e} > {REL_TOL}"
    for other in dp[1:]:
        for name, value in other["params"].items():
            assert torch.equal(value, dp[0]["params"][name]), f"replica drift in {name}"


def _gradients(rank: int, world: int, overrides: list[str]) -> dict[str, torch.Tensor]:
    return gradients_of(first_gradients(rank, overrides))


def test_dp_gradients_match_single_for_every_parameter() -> None:
    base = [*SMALL_RUN, *TWO_BY_TWO]
    single = run_ranks(_gradients, 1, [*base, "parallel.sequence=single"])[0]
    dp = run_ranks(_gradients, 4, [*base, "parallel.sequence=whole"])
    assert set(dp[0]) == set(single)
    for name, ref in single.items():
        diff = (dp[0][name] - ref).abs()
        rel = float(diff.norm() / ref.norm())
        assert rel <= REL_TOL, (
            f"gradient of {name}: relative error {rel:.2e}, max abs {float(diff.max()):.2e}, "
            f"mean abs {float(diff.mean()):.2e}"
        )
        assert float(ref.norm()) > 0, f"gradient of {name} is zero: the check would be vacuous"


def _small_dataset(path: Path) -> Path:
    rng = np.random.default_rng(7)
    # ~1500 tokens: six steps of at most 2 x 192 tokens cross at least one epoch.
    lengths = [1, 2, 3, 191, 192, 193, 400, *rng.integers(1, 200, size=5).tolist()]
    docs = [rng.integers(0, 256, size=n, dtype=np.int32) for n in lengths]
    return write_token_parquet(docs, path).path


def test_resume_matches_uninterrupted_run_and_loses_no_sample(tmp_path: Path) -> None:
    """With outlier delay on: the checkpoint of step 3 is taken while document 3 waits
    (held at batch 2), so the resumed stream must carry the held queue."""
    data = _small_dataset(tmp_path / "docs.parquet")
    base = [
        *SMALL_RUN,
        "topology.gpus_per_node=2",
        f"data.source={data}",
        "train.checkpoint_every=0",
        "data.outlier_tokens=150",
    ]
    full = run_ranks(train_rank, 2, [*base, "train.steps=6", f"train.out_dir={tmp_path / 'a'}"])
    first = run_ranks(train_rank, 2, [*base, "train.steps=3", f"train.out_dir={tmp_path / 'b'}"])
    for rank in (0, 1):  # a step trained after the checkpoint, then lost in a crash
        with ledger_path(tmp_path / "b", rank).open("a") as ledger:
            ledger.write(json.dumps({"step": 4, "docs": [0], "starts": [0], "lengths": [1]}) + "\n")
    second = run_ranks(train_rank, 2, [*base, "train.steps=6", f"train.out_dir={tmp_path / 'b'}"])

    assert second[0]["events"][0] == {"event": "start", "step": 3}
    resumed_losses = {**first[0]["losses"], **second[0]["losses"]}
    assert resumed_losses == full[0]["losses"], "resumed losses differ from the uninterrupted run"
    for name, value in full[0]["params"].items():
        assert torch.equal(second[0]["params"][name], value), f"parameter {name} differs"
    resumed_samples = {**first[0]["samples"], **second[0]["samples"]}
    assert resumed_samples == full[0]["samples"]
    lengths = {i: n for i, n in enumerate(_lengths_of(data))}
    epochs = assert_each_token_once_per_epoch(
        [piece for step in sorted(resumed_samples) for piece in resumed_samples[step]], lengths
    )
    assert epochs >= 1, "the run should cross an epoch boundary to test the shuffled order"
    ledger = read_ledger(tmp_path / "b")
    assert ledger == read_ledger(tmp_path / "a"), "the ledger must rewind with the run"
    by_step = {step + 1: sorted(pieces) for step, pieces in full[0]["samples"].items()}
    assert {step: sorted(pieces) for step, pieces in ledger.items()} == by_step


def _lengths_of(path: Path) -> list[int]:
    from ray_zep.data.source import ParquetSource

    return ParquetSource(path).lengths.tolist()


SILENT_AT_MOST_S = 12.0
"""The silent peer answers nothing until rank 0's collectives have both ended, or this
long (each must fail within 5 s)."""


def _stall(rank: int, world: int, done: Path) -> list[tuple[float, str]] | None:
    topology = build_topology(load_config(None, ["topology.gpus_per_node=2"]).topology)
    comm = create_comm(load_config(None), topology, timeout_s=2.0)
    if rank == 1:  # a peer that stops answering
        deadline = time.monotonic() + SILENT_AT_MOST_S
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    outcomes = []
    for name, collective in [
        ("all-reduce", lambda: sum_over_ranks_(torch.ones(4), comm, "the test tensor")),
        ("barrier", lambda: dist.barrier(group=comm.group)),  # blocking, as in checkpoints
    ]:
        started = time.perf_counter()
        try:
            collective()
            message = "no error"
        except (CommError, RuntimeError) as exc:
            message = str(exc)
        outcomes.append((name, time.perf_counter() - started, message))
    done.touch()
    return outcomes


def test_silent_peer_raises_comm_error_within_timeout(tmp_path: Path) -> None:
    """Async collectives wait through `Comm.wait`; blocking ones (barriers, checkpoint
    I/O) run on the Comm's group, created with the same timeout."""
    outcomes = run_fresh_ranks(_stall, 2, tmp_path / "rank0_done")[0]
    (_, elapsed, message), (_, barrier_elapsed, barrier_message) = outcomes
    assert "comm.timeout_s=2" in message, message
    assert elapsed < 5.0, f"timed out after {elapsed:.1f} s with a 2 s timeout"
    assert barrier_message != "no error"
    assert barrier_elapsed < 5.0, f"the barrier failed after {barrier_elapsed:.1f} s"


def test_topology_must_match_the_process_count() -> None:
    topology = build_topology(load_config(None, TWO_BY_TWO).topology)
    with pytest.raises(TopologyError, match=r"needs 4 process\(es\).*but 1 are running"):
        create_comm(load_config(None), topology, timeout_s=5.0)
