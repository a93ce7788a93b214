"""The sample ledger: which pieces of which documents every rank trained on.

Each rank appends one line per finished step to
`<train.out_dir>/samples/rank_<r>.jsonl`:

    {"step": 7, "docs": [...], "starts": [...], "lengths": [...]}

`step` is 1-based, as in metrics.jsonl; piece i is tokens
[starts[i], starts[i] + lengths[i]) of document docs[i]. When training
(re)starts after step k, every rank first drops its lines of later steps
(`ray_zep.steplog`), and rank 0 does the same for the files of ranks an elastic
run no longer has, so the ledger always describes exactly the batches behind
the newest parameters: after a restart, nothing is listed twice and nothing
trained is missing.
"""

from __future__ import annotations

from pathlib import Path

from ray_zep import steplog
from ray_zep.data.shards import RankShard

LEDGER_DIR_NAME = "samples"

Piece = tuple[int, int, int]
"""(document, start, length)."""


def ledger_path(run_dir: Path, rank: int) -> Path:
    return run_dir / LEDGER_DIR_NAME / f"rank_{rank:05d}.jsonl"


class SampleLedger:
    """One rank's ledger file."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = ledger_path(run_dir, rank)

    def rewind(self, step: int) -> None:
        """Keep only the lines of steps <= `step` (training resumes after it)."""
        steplog.rewind(self.path, step)

    def record(self, step: int, shard: RankShard) -> None:
        """Append the pieces this rank trained on in (1-based) `step`."""
        row = {
            "step": step,
            "docs": shard.docs.tolist(),
            "starts": shard.starts.tolist(),
            "lengths": shard.lengths.tolist(),
        }
        steplog.append_row(self.path, row)


def rewind_departed(run_dir: Path, world_size: int, step: int) -> None:
    """Rewind the files of ranks >= `world_size` to `step`: an elastic run that resumes on
    fewer ranks than wrote the ledger before (rank 0 calls it; the live ranks rewind
    their own files)."""
    for path in sorted((run_dir / LEDGER_DIR_NAME).glob("rank_*.jsonl")):
        if int(path.stem.removeprefix("rank_")) >= world_size:
            steplog.rewind(path, step)


def read_ledger(run_dir: Path) -> dict[int, list[Piece]]:
    """Every step's pieces over all ranks, in rank order.

    Raises:
        FileNotFoundError: the run wrote no ledger.
    """
    files = sorted((run_dir / LEDGER_DIR_NAME).glob("rank_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no sample ledger under {run_dir / LEDGER_DIR_NAME}")
    steps: dict[int, list[Piece]] = {}
    for path in files:
        for row in steplog.read_rows(path):
            pieces = zip(row["docs"], row["starts"], row["lengths"], strict=True)
            steps.setdefault(row["step"], []).extend(pieces)
    return dict(sorted(steps.items()))
