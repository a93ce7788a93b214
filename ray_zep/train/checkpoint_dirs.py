"""Where checkpoints live and which one a run resumes from: the step folders under
`<train.out_dir>/checkpoints/`, their COMPLETE markers and the pruning of old ones.

Read without torch.distributed.checkpoint, so that the driver, which only finds and
checks checkpoints, starts without it (`ray_zep.train.checkpoint` saves and loads them).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_zep import constants
from ray_zep.config import ResumeMode
from ray_zep.errors import CheckpointError

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class Progress:
    """Where training stands: steps done and the data cursor after them."""

    step: int
    cursor: dict[str, Any]


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / constants.CHECKPOINT_DIR_NAME


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step_{step:08d}"


def _step_folders(run_dir: Path) -> list[tuple[int, bool, Path]]:
    """(step, complete, folder) of every checkpoint folder under `run_dir`, by step."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted(
        (int(m.group(1)), (p / constants.CHECKPOINT_COMPLETE_MARKER).is_file(), p)
        for p in root.iterdir()
        if (m := STEP_DIR.match(p.name))
    )


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint under `run_dir`, or None."""
    complete = [p for _, done, p in _step_folders(run_dir) if done]
    return complete[-1] if complete else None


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete the complete checkpoints older than the newest `keep`, and interrupted saves
    older than the newest complete one (no run resumes from either); `keep` 0 deletes
    nothing. Rank 0 calls it after a save.

    Returns:
        The folders deleted, oldest first.
    """
    found = _step_folders(run_dir) if keep > 0 else []
    complete = [step for step, done, _ in found if done]
    if not complete:
        return []
    kept = set(complete[-keep:])
    newest = complete[-1]
    doomed = [p for step, done, p in found if (done and step not in kept) or
              (not done and step < newest)]  # fmt: skip
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    if doomed:
        log.info("deleted %d checkpoint(s) before step %d (train.keep_checkpoints=%d)",
                 len(doomed), min(kept), keep)  # fmt: skip
    return doomed


def resume_checkpoint(run_dir: Path, resume: ResumeMode, ep: int) -> Path | None:
    """The checkpoint a run in `run_dir` continues from, or None to start fresh.

    Raises:
        CheckpointError: `run_dir` holds checkpoints and `train.resume=never`, or
            the newest was saved with another `parallel.ep`.
    """
    found = latest_checkpoint(run_dir)
    if found is None:
        return None
    if resume is ResumeMode.NEVER:
        raise CheckpointError(
            f"train.out_dir={str(run_dir)!r} already holds checkpoints and train.resume=never; "
            "choose a new train.out_dir or train.resume=auto"
        )
    check_resumable(found, ep)
    return found


def check_resumable(path: Path, ep: int) -> dict[str, Any]:
    """The checkpoint's marker, if this run can resume from it.

    Raises:
        CheckpointError: incomplete, or saved with another `parallel.ep`.
    """
    marker = read_marker(path)
    saved = marker.get("ep", 1)
    if saved != ep:
        raise CheckpointError(
            f"checkpoint {path} was saved with parallel.ep={saved}, this run has "
            f"parallel.ep={ep}: the expert shards are named by it; resume with "
            f"parallel.ep={saved} or use a new train.out_dir"
        )
    return marker


def read_marker(path: Path) -> dict[str, Any]:
    """The COMPLETE marker of the checkpoint at `path`.

    Raises:
        CheckpointError: no marker (an interrupted save), or one that is not JSON.
    """
    marker = path / constants.CHECKPOINT_COMPLETE_MARKER
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete (no {marker.name} marker)")
    try:
        return json.loads(marker.read_text())
    except json.JSONDecodeError:
        raise CheckpointError(f"checkpoint marker {marker} is not valid JSON") from None
