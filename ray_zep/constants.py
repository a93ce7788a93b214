"""Environment knobs and default timeouts, in one place.

Timeouts are in seconds. Start-up (rendezvous, worker-group start) and
steady-state (every collective, every shard fetch) timeouts are separate so a
slow cluster start does not make a stuck step wait as long.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV_VAR = "RAY_ZEP_CACHE_DIR"
"""Where built-in datasets are cached; defaults to ~/.cache/ray_zep."""

LOG_LEVEL_ENV_VAR = "RAY_ZEP_LOG_LEVEL"
"""Log level of the library on rank 0 (other ranks log one level lower)."""

DEFAULT_INIT_TIMEOUT_S = 300.0
"""Process-group rendezvous and worker-group start."""

DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
"""Any single collective or point-to-point operation in steady state."""

DEFAULT_METRICS_PORT = 9450
"""Port of the driver's Prometheus endpoint."""

IGNORE_INDEX = -100
"""Label value of positions that have no next token (the last token of a sequence)."""

CHECKPOINT_DIR_NAME = "checkpoints"
CHECKPOINT_COMPLETE_MARKER = "COMPLETE"
METRICS_FILE_NAME = "metrics.jsonl"
RESOLVED_CONFIG_FILE_NAME = "config.yaml"


def cache_dir() -> Path:
    """Directory for cached datasets, created on demand."""
    root = os.environ.get(CACHE_DIR_ENV_VAR) or os.path.join(
        os.path.expanduser("~"), ".cache", "ray_zep"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
