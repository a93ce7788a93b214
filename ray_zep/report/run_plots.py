"""Pictures of a training run, drawn from its metrics.jsonl into the run directory.

    loss.png        loss per step
    throughput.png  tokens/s per step, with the steady-state mean as a line
    load.png        per rank: tokens per step (and FLOPs per step where the rows have
                    `rank_flops`) as the mean over steps with the min-max range

Step rows are the rows with "step" and "step_seconds". The steady state is every
step but the first of the file (process-group warm-up, first plan), the same rule
`ray-zep bench train` uses. A run resumed under another number of ranks has rows
of different lengths; a rank's statistics then cover the steps it existed in.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ray_zep import steplog
from ray_zep.constants import METRICS_FILE_NAME
from ray_zep.errors import ConfigError
from ray_zep.report.figures import have_matplotlib, save_figure, skip_message

log = logging.getLogger(__name__)

RUN_PICTURES = ("loss.png", "throughput.png", "load.png")
"""The file names `draw_run` writes, in order."""


def draw_run(run_dir: Path) -> list[Path]:
    """Draw loss.png, throughput.png and load.png of the run in `run_dir`.

    Args:
        run_dir: a run directory (`train.out_dir`) holding metrics.jsonl.

    Returns:
        The pictures written; none when matplotlib is not installed (logged once)
        or the file has no step rows yet.

    Raises:
        ConfigError: `run_dir` has no metrics.jsonl.
    """
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS_FILE_NAME
    if not metrics.is_file():
        raise ConfigError(
            f"{run_dir} has no {METRICS_FILE_NAME}: give the train.out_dir of a run "
            f"that trained at least one step"
        )
    rows = steplog.step_rows(metrics)
    if not rows:
        log.info("no pictures of %s: %s has no step rows yet", run_dir, METRICS_FILE_NAME)
        return []
    if not have_matplotlib():
        log.warning(skip_message(f"pictures {', '.join(RUN_PICTURES)} of {run_dir}"))
        return []
    drawn = [
        draw_loss(rows, run_dir / "loss.png"),
        draw_step_throughput(rows, run_dir / "throughput.png"),
        draw_load(rows, run_dir / "load.png"),
    ]
    return [path for path in drawn if path is not None]


def steady_tokens_per_second(rows: Sequence[dict[str, Any]]) -> float:
    """Tokens over seconds of every step row but the first (all of them if only one)."""
    steady = rows[1:] or rows
    seconds = sum(r["step_seconds"] for r in steady)
    return sum(r.get("tokens", 0) for r in steady) / seconds if seconds > 0 else 0.0


def draw_loss(rows: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Loss (nats per label token) against step; None when matplotlib is missing."""
    return save_figure(path, partial(_draw_loss, rows), size=(8.0, 4.0))


def _draw_loss(rows: Sequence[dict[str, Any]], figure: Any, axes: Any) -> None:
    ax = axes[0, 0]
    kept = [r for r in rows if r.get("loss") is not None]
    steps = [r["step"] for r in kept]
    ax.plot(steps, [r["loss"] for r in kept], marker="." if len(kept) <= 50 else None)
    ax.set_title(f"training loss, steps {steps[0]}..{steps[-1]}" if steps else "no loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per label token)")
    ax.grid(alpha=0.3)


def draw_step_throughput(rows: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Tokens/s per step and the steady-state mean; None when matplotlib is missing."""
    return save_figure(path, partial(_draw_step_throughput, rows), size=(8.0, 4.0))


def _draw_step_throughput(rows: Sequence[dict[str, Any]], figure: Any, axes: Any) -> None:
    ax = axes[0, 0]
    steps = [r["step"] for r in rows]
    speeds = [_tokens_per_second(r) for r in rows]
    ax.plot(steps, speeds, marker="." if len(rows) <= 50 else None, label="per step")
    mean = steady_tokens_per_second(rows)
    first = rows[1]["step"] if len(rows) > 1 else steps[0]
    label = f"steady-state mean, steps {first}..{steps[-1]}: {mean:,.0f}"
    ax.axhline(mean, color="C1", linestyle="--", label=label)
    ax.set_title("training throughput")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _tokens_per_second(row: dict[str, Any]) -> float:
    if row.get("tokens_per_second") is not None:
        return float(row["tokens_per_second"])
    seconds = row["step_seconds"]
    return row.get("tokens", 0) / seconds if seconds > 0 else 0.0


def draw_load(rows: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Per-rank tokens per step (and FLOPs per step where rows have `rank_flops`).

    Returns:
        `path`; None when matplotlib is missing or no row has `rank_tokens`.
    """
    panels = [
        (key, matrix)
        for key in ("rank_tokens", "rank_flops")
        if (matrix := rank_matrix(rows, key)) is not None
    ]
    if not panels:
        log.info("no load picture: the step rows have no rank_tokens")
        return None
    width = max(6.0, min(16.0, 2.0 + 0.3 * panels[0][1].shape[1])) * len(panels)
    draw = partial(_draw_load, panels)
    return save_figure(path, draw, size=(width, 4.2), cols=len(panels))


def rank_matrix(rows: Sequence[dict[str, Any]], key: str) -> np.ndarray | None:
    """Steps x ranks array of the rows' `key` lists (NaN where a step had fewer ranks).

    Returns None when no row has a non-empty list under `key`.
    """
    lists = [r[key] for r in rows if isinstance(r.get(key), list) and r[key]]
    if not lists:
        return None
    matrix = np.full((len(lists), max(len(v) for v in lists)), np.nan)
    for index, values in enumerate(lists):
        matrix[index, : len(values)] = [np.nan if v is None else v for v in values]
    return matrix


def imbalance(matrix: np.ndarray) -> tuple[float, float]:
    """(mean, worst) over steps of max/mean over ranks; 1.0 is perfect balance."""
    means = np.nanmean(matrix, axis=1)
    ratios = np.where(means > 0, np.nanmax(matrix, axis=1) / np.where(means > 0, means, 1), 1.0)
    return float(ratios.mean()), float(ratios.max())


def _draw_load(panels: list[tuple[str, np.ndarray]], figure: Any, axes: Any) -> None:
    for ax, (key, matrix) in zip(axes[0], panels, strict=True):
        scale, unit = (1.0, "tokens") if key == "rank_tokens" else _flop_unit(matrix)
        _rank_bars(ax, matrix / scale)
        mean, worst = imbalance(matrix)
        ax.set_title(f"{unit} per rank over {matrix.shape[0]} steps")
        ax.set_xlabel("rank")
        ax.set_ylabel(f"{unit} per step (mean, min-max)")
        note = f"imbalance max/mean per step: mean {mean:.3f}, worst {worst:.3f}"
        ax.text(0.99, 0.97, note, transform=ax.transAxes, ha="right", va="top", fontsize=8)


def _rank_bars(ax: Any, matrix: np.ndarray) -> None:
    """Mean per rank as a bar, the min-max range over steps as an error bar."""
    mean = np.nanmean(matrix, axis=0)
    # rounding can put the mean of equal values a hair outside them: no negative bars
    low = np.maximum(mean - np.nanmin(matrix, axis=0), 0.0)
    high = np.maximum(np.nanmax(matrix, axis=0) - mean, 0.0)
    ranks = np.arange(matrix.shape[1])
    ax.bar(ranks, mean, yerr=[low, high], capsize=3, color="C0", ecolor="black", width=0.7)
    ax.axhline(float(np.nanmean(matrix)), color="C1", linestyle="--", label="mean of all ranks")
    ax.set_xticks(ranks, [str(r) for r in ranks], fontsize=7 if len(ranks) > 16 else 9)
    ax.set_ylim(0, 1.25 * float(np.nanmax(matrix)) or 1.0)  # room for the legend and the note
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def _flop_unit(matrix: np.ndarray) -> tuple[float, str]:
    """A divisor and unit name that keep per-rank FLOPs between about 1 and 1000."""
    peak = float(np.nanmax(matrix)) if matrix.size else 0.0
    for scale, name in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
        if peak >= scale:
            return scale, name
    return 1.0, "FLOP"
