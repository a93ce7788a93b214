"""JSON-lines files with one row per training step: metrics.jsonl and the sample ledger.

Rows are appended as steps finish. When training (re)starts after step k,
`rewind` drops the rows of later steps, so the file always describes the
history behind the newest parameters, with no step listed twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def append_row(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(row) + "\n")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of `path` (none if it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_rows(path: Path) -> list[dict[str, Any]]:
    """The step rows of a metrics.jsonl (those with "step" and "step_seconds"; evaluation
    rows have no step time), in file order."""
    return [r for r in read_rows(path) if "step" in r and "step_seconds" in r]


def rewind(path: Path, step: int) -> None:
    """Keep only the rows of steps <= `step` (replacing the file atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = [row for row in read_rows(path) if row.get("step", 0) <= step]
    scratch = path.with_name(path.name + ".tmp")
    scratch.write_text("".join(json.dumps(row) + "\n" for row in kept))
    os.replace(scratch, path)
