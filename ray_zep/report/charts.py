"""Grouped bar charts on matplotlib axes (the benchmark pictures).

Only called from inside a `figures.save_figure` callback, so matplotlib is
already known to be importable here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MISSING = "n/a"
"""Written on the axis where a group has no value for a series."""


def grouped_bars(
    axes: Any,
    groups: Sequence[str],
    series: Sequence[str],
    values: Sequence[Sequence[float | None]],
    *,
    title: str,
    ylabel: str,
    xlabel: str = "",
) -> None:
    """Bars of values[group][series]: one cluster per group, one colour per series.

    Bars start at zero on one linear scale and carry their value on top; a None
    value draws no bar and an "n/a" mark instead. A legend right of the axes names
    the series when there is more than one.

    Args:
        axes: a matplotlib Axes.
        groups: the x tick labels, one per cluster.
        series: the names of the bars inside each cluster (legend entries).
        values: len(groups) rows of len(series) values, in the unit `ylabel` says.
        title, ylabel, xlabel: the axes' texts.
    """
    width = 0.8 / max(1, len(series))
    for s, name in enumerate(series):
        xs = [g + (s - (len(series) - 1) / 2) * width for g in range(len(groups))]
        heights = [_at(row, s) for row in values]
        bars = axes.bar(xs, [h or 0.0 for h in heights], width * 0.95, label=name)
        labels = [MISSING if h is None else short(h) for h in heights]
        axes.bar_label(bars, labels, fontsize=7, padding=1, rotation=90 if len(xs) > 24 else 0)
    tilted = {"rotation": 30, "ha": "right"} if len(groups) > 6 else {}
    axes.set_xticks(range(len(groups)), groups, **tilted)
    axes.set_title(title)
    axes.set_ylabel(ylabel)
    if xlabel:
        axes.set_xlabel(xlabel)
    axes.margins(y=0.15)
    axes.grid(axis="y", alpha=0.3)
    if len(series) > 1:  # beside the axes: inside, it would hide bars
        axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def short(value: float) -> str:
    """A bar label with about three significant digits."""
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _at(row: Sequence[float | None], index: int) -> float | None:
    value = row[index] if index < len(row) else None
    return None if value is None else float(value)
