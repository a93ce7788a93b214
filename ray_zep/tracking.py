"""Experiment tracking: TensorBoard (`metrics.tensorboard`) and Weights & Biases
(`metrics.wandb`), fed the rows the driver writes to metrics.jsonl.

One record, three sinks: the driver builds each step's row once (`MetricsExporter`),
appends it to metrics.jsonl and hands the same row to every tracker, which logs
`row_scalars(row)`: every number in it under its key, nested keys joined with `/`
(`comm_bytes/inter_node`, `compression/kv/raw_bytes`, `rss_bytes/driver`), and a
per-rank list as its `max` and `mean` (`rank_tokens/max`, `rss_bytes/ranks/max`).

A resumed run (Ray Train's restart, or the same `train.out_dir` again) continues its
records: TensorBoard drops the events after the resumed step (`purge_step`), and W&B
keeps one run per run directory (its id comes from the directory), plotted against the
`step` metric so that steps trained again after a restart are logged again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from ray_zep.config import MetricsConfig
from ray_zep.errors import ConfigError, first_line

log = logging.getLogger(__name__)

NOT_SCALARS = ("step", "time")
"""Row keys that are the x-axis (`step`) or that the sinks stamp themselves (`time`)."""
TENSORBOARD_FLUSH_S = 10
"""How often TensorBoard's writer flushes: a live TensorBoard sees a step this late."""
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""metrics.<key> -> the package it needs (and the ray-zep extra of the same name)."""


def row_scalars(row: dict[str, Any]) -> dict[str, float]:
    """Every number of a metrics.jsonl row, by its slash-joined key (see the module)."""
    scalars: dict[str, float] = {}
    for key, value in row.items():
        if key not in NOT_SCALARS:
            _collect(key, value, scalars)
    return scalars


def _collect(name: str, value: Any, into: dict[str, float]) -> None:
    if isinstance(value, bool | int | float):
        into[name] = float(value)
    elif isinstance(value, dict):
        for key, inner in value.items():
            _collect(f"{name}/{key}", inner, into)
    elif isinstance(value, list):
        numbers = list(_numbers(value))
        if numbers:
            into[f"{name}/max"] = max(numbers)
            into[f"{name}/mean"] = sum(numbers) / len(numbers)


def _numbers(values: list[Any]) -> Iterator[float]:
    for value in values:
        if isinstance(value, list):
            yield from _numbers(value)
        elif isinstance(value, bool | int | float):
            yield float(value)


class Tracker(Protocol):
    name: str

    def start(self, step: int) -> None:
        """Training (re)starts after `step` (0: fresh)."""

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def check_trackers(metrics: MetricsConfig) -> None:
    """Refuse a tracker whose package is missing, before anything starts.

    Raises:
        ConfigError: naming the key and the extra to install.
    """
    for key, package in EXTRAS.items():
        if getattr(metrics, key) and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"config key metrics.{key}={getattr(metrics, key)!r} needs the {package} "
                f"package: pip install 'ray-zep[{package}]' (or unset metrics.{key})"
            )


def open_trackers(metrics: MetricsConfig, run_dir: Path, config: dict[str, Any]) -> list[Tracker]:
    """The trackers the config asks for.

    Args:
        metrics: the `metrics` section.
        run_dir: the run directory (TensorBoard's relative directory and W&B's files).
        config: the resolved config as plain data (recorded by both).

    Raises:
        ConfigError: a package is missing, or W&B refuses to start (no login and not
            offline).
    """
    check_trackers(metrics)
    trackers: list[Tracker] = []
    if metrics.tensorboard:
        trackers.append(TensorBoardTracker(run_dir / Path(metrics.tensorboard).expanduser()))
    if metrics.wandb:
        trackers.append(WandbTracker(metrics.wandb, metrics.wandb_run, run_dir, config))
    return trackers


class TensorBoardTracker:
    """Scalars as TensorBoard events in `log_dir` (torch's SummaryWriter)."""

    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._writer = None

    def start(self, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.close()
        self._writer = SummaryWriter(
            str(self.log_dir), purge_step=step + 1 if step else None, flush_secs=TENSORBOARD_FLUSH_S
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self._writer is None:
            self.start(0)
        for name, value in scalars.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbTracker:
    """Scalars as one W&B run per run directory, plotted against `step`."""

    name = "wandb"

    def __init__(
        self, project: str, run_name: str | None, run_dir: Path, config: dict[str, Any]
    ) -> None:
        import wandb

        run_id = "rz-" + hashlib.sha1(str(run_dir).encode()).hexdigest()[:16]
        try:
            self._run = wandb.init(
                project=project,
                name=run_name or run_dir.name,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                config=config,
                settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as exc:  # W&B's own errors vary: no login, no network, bad project
            reason = first_line(exc)
            raise ConfigError(
                f"config key metrics.wandb={project!r}: W&B did not start ({reason}); log in "
                "(`wandb login` or WANDB_API_KEY), or set WANDB_MODE=offline"
            ) from None
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def start(self, step: int) -> None:
        """W&B keeps every point; a restart's repeated steps are logged again."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log({"step": step, **scalars})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
