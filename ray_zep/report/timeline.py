"""Pictures of simulated steps: per-rank timelines (like the Zeppelin paper's Fig. 12)
and throughput bars (like its Fig. 8)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from ray_zep.report.charts import grouped_bars
from ray_zep.report.figures import save_figure
from ray_zep.sim.events import Lane, Timeline

LANE_COLORS: dict[Lane, str] = {
    Lane.COMPUTE: "#3c78be",
    Lane.INTRA_NODE: "#3c9650",
    Lane.INTER_NODE: "#c83c32",
}
LANE_HEIGHT = 0.28
"""Height of one lane in rank rows (three lanes and a gap fill one row)."""


def draw_timelines(
    panels: Sequence[tuple[str, Timeline]], ranks: Sequence[int], path: Path
) -> Path | None:
    """One panel per (title, timeline): for each rank in `ranks`, its compute,
    intra-node and inter-node lanes on the panel's own time axis (ms).

    Returns:
        `path`, or None when matplotlib is not installed (the picture is skipped).
    """
    height = 0.5 + len(panels) * (0.7 + 0.17 * len(ranks))
    draw = partial(_draw_timelines, panels, ranks)
    return save_figure(path, draw, size=(11.0, height), rows=max(1, len(panels)))


def _draw_timelines(
    panels: Sequence[tuple[str, Timeline]], ranks: Sequence[int], figure: Any, axes: Any
) -> None:
    from matplotlib.patches import Patch

    for ax, (title, timeline) in zip(axes[:, 0], panels, strict=False):
        span_ms = timeline.makespan * 1e3
        for row, rank in enumerate(ranks):
            for offset, (lane, color) in enumerate(LANE_COLORS.items()):
                blocks = [
                    (start * 1e3, (end - start) * 1e3)
                    for start, end, _ in timeline.intervals(rank, lane)
                ]
                y = row - 0.45 + offset * LANE_HEIGHT
                ax.broken_barh(blocks, (y, LANE_HEIGHT * 0.9), facecolors=color)
        ax.set_xlim(0, span_ms or 1.0)
        ax.set_ylim(len(ranks) - 0.5, -0.5)
        ax.set_yticks(range(len(ranks)), [f"r{r}" for r in ranks], fontsize=6)
        ax.set_ylabel("rank")
        ax.set_xlabel("time (ms)")
        ax.set_title(f"{title}: {span_ms:.2f} ms", fontsize=9)
    handles = [
        Patch(color=c, label=lane.value.replace("_", "-")) for lane, c in LANE_COLORS.items()
    ]
    figure.legend(handles=handles, loc="outside upper center", ncols=len(handles), fontsize=8)


def draw_throughput(
    title: str, names: Sequence[str], tokens_per_second: Sequence[float | None], path: Path
) -> Path | None:
    """Bars of tokens/s (thousands) per strategy; None: the strategy has no number.

    Returns:
        `path`, or None when matplotlib is not installed (the picture is skipped).
    """
    values = [[None if v is None else v / 1e3] for v in tokens_per_second]
    draw = partial(_draw_throughput, title, names, values)
    return save_figure(path, draw, size=(max(5.0, 1.1 * len(names)), 3.8))


def _draw_throughput(
    title: str, names: Sequence[str], values: list[list[float | None]], figure: Any, axes: Any
) -> None:
    grouped_bars(
        axes[0, 0],
        list(names),
        ["throughput"],
        values,
        title=title,
        ylabel="throughput (thousand tokens/s)",
        xlabel="strategy",
    )
