"""What a long run's metrics.jsonl says about its flatness (`ray-zep bench soak`).

Every step row carries the resident memory and open file descriptors of the driver,
the data actor and each rank (`rss_bytes`, `open_fds`), and the step's wall time. After
the warm-up, each process's figure is compared between two windows: the first steps
after the warm-up and the last steps of the run, each by its median (a step that
happens to run beside a checkpoint save or a garbage collection moves neither). The
step time is judged the same way, and by the drift of a least-squares line through all
steady steps over the run's length.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ray_zep.errors import ConfigError
from ray_zep.report.figures import save_figure

RSS_GROWTH_GOAL = 0.05
"""At most 5% more resident memory at the end than after the warm-up, per process."""
STEP_DRIFT_GOAL = 0.05
"""Step time at the end within 5% of after the warm-up (windows and fitted line)."""
FD_SLACK = 2
"""Open descriptors may differ by this many (a log file being rotated, a socket)."""
DRIVER, DATA = "driver", "data"


@dataclass(frozen=True)
class ProcessFlatness:
    process: str
    """`driver`, `data` or `rank <r>`."""
    rss_start: float
    """Median resident bytes over the window after the warm-up."""
    rss_end: float
    """Median resident bytes over the last window."""
    fds_start: float
    fds_end: float

    @property
    def rss_growth(self) -> float:
        return self.rss_end / self.rss_start - 1 if self.rss_start else 0.0

    @property
    def flat(self) -> bool:
        fds_ok = self.fds_end <= self.fds_start + max(FD_SLACK, RSS_GROWTH_GOAL * self.fds_start)
        return self.rss_growth <= RSS_GROWTH_GOAL and fds_ok


@dataclass(frozen=True)
class SoakReport:
    steps: int
    warm_up: int
    window: int
    """Steps in each compared window."""
    processes: list[ProcessFlatness]
    step_start: float
    """Median step seconds over the window after the warm-up."""
    step_end: float
    step_fit_drift: float
    """The fitted line's change over the steady steps, over its mean."""
    step_noise: float
    """Relative spread of the steady step times (interquartile range over the median)."""

    @property
    def step_drift(self) -> float:
        return self.step_end / self.step_start - 1

    @property
    def step_flat(self) -> bool:
        return max(abs(self.step_drift), abs(self.step_fit_drift)) <= STEP_DRIFT_GOAL


def process_series(rows: Sequence[dict[str, Any]], figure: str) -> dict[str, list[float]]:
    """Per process, `figure` (`rss_bytes` or `open_fds`) at every step row (NaN where a row
    lacks it: the data actor before it first answered)."""
    ranks = max(len(row.get(figure, {}).get("ranks", [])) for row in rows)
    names = [DRIVER, DATA, *(f"rank {r}" for r in range(ranks))]
    series: dict[str, list[float]] = {name: [] for name in names}
    for row in rows:
        found = row.get(figure, {})
        per_rank = found.get("ranks", [])
        for name in names:
            if name.startswith("rank "):
                r = int(name.split()[1])
                series[name].append(float(per_rank[r]) if r < len(per_rank) else float("nan"))
            else:
                series[name].append(float(found.get(name, float("nan"))))
    return series


def soak_report(rows: Sequence[dict[str, Any]], warm_up: int) -> SoakReport:
    """How flat a run stayed after its first `warm_up` steps.

    Raises:
        ConfigError: too few steps after the warm-up for two windows of 10.
    """
    steady = len(rows) - warm_up
    if steady < 20:
        raise ConfigError(
            f"--warm-up={warm_up}: {len(rows)} steps leave {steady} after it; two windows "
            "of 10 steps need 20"
        )
    window = max(10, steady // 10)

    def ends(values: Sequence[float]) -> tuple[float, float]:
        start = _median(values[warm_up : warm_up + window])
        return start, _median(values[len(values) - window :])

    rss, fds = process_series(rows, "rss_bytes"), process_series(rows, "open_fds")
    processes = [ProcessFlatness(name, *ends(rss[name]), *ends(fds[name])) for name in rss]
    seconds = np.array([row["step_seconds"] for row in rows[warm_up:]])
    slope, _ = np.polyfit(np.arange(len(seconds)), seconds, 1)
    q1, median, q3 = np.percentile(seconds, [25, 50, 75])
    return SoakReport(
        len(rows),
        warm_up,
        window,
        processes,
        *ends([row["step_seconds"] for row in rows]),
        float(slope * (len(seconds) - 1) / seconds.mean()),
        float((q3 - q1) / median),
    )


def _median(values: Sequence[float]) -> float:
    known = [v for v in values if v == v]
    return statistics.median(known) if known else float("nan")


def draw_soak(path: Path, rows: Sequence[dict[str, Any]], report: SoakReport) -> Path | None:
    """Resident memory and open descriptors per process, and step time, over the run."""
    steps = [row["step"] for row in rows]
    rss, fds = process_series(rows, "rss_bytes"), process_series(rows, "open_fds")
    seconds = np.array([row["step_seconds"] for row in rows])
    rolling = [float(np.median(seconds[max(0, i - report.window + 1) : i + 1]))
               for i in range(len(seconds))]  # fmt: skip

    def draw(_figure, axes) -> None:
        memory, handles, timing = axes[0, 0], axes[1, 0], axes[2, 0]
        for name, values in rss.items():
            memory.plot(steps, [v / 2**20 for v in values], label=name, linewidth=1)
        memory.set_ylabel("resident MiB")
        memory.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        for name, values in fds.items():
            handles.plot(steps, values, label=name, linewidth=1)
        handles.set_ylabel("open descriptors")
        timing.plot(steps, seconds, linewidth=0.4, alpha=0.4, label="each step")
        timing.plot(steps, rolling, linewidth=1.2, label=f"median of {report.window}")
        timing.set_ylabel("step seconds")
        timing.set_xlabel("step")
        timing.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        for ax in (memory, handles, timing):
            ax.axvline(report.warm_up, color="grey", linestyle=":", linewidth=1)
            ax.grid(alpha=0.3)
        memory.set_title(f"{report.steps} steps; dotted: end of the warm-up")

    return save_figure(path, draw, size=(10.0, 8.0), rows=3, sharex=True)
