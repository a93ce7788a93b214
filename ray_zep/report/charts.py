"""Grouped bar charts on a Canvas (for benchmark PNGs)."""

from __future__ import annotations

from collections.abc import Sequence

from ray_zep.report.png import BLACK, GREY, Canvas, Color

PALETTE: tuple[Color, ...] = (
    (200, 60, 50),
    (240, 150, 40),
    (60, 120, 190),
    (110, 170, 220),
    (60, 150, 80),
    (150, 100, 180),
    (120, 120, 120),
    (180, 140, 90),
)


def legend(canvas: Canvas, x: int, y: int, series: Sequence[str]) -> None:
    for index, name in enumerate(series):
        canvas.fill(x, y, x + 10, y + 10, PALETTE[index % len(PALETTE)])
        x += 14 + canvas.text(x + 14, y + 2, name) + 12


def bar_panel(
    canvas: Canvas,
    box: tuple[int, int, int, int],
    title: str,
    groups: Sequence[str],
    values: Sequence[Sequence[float | None]],
) -> None:
    """Bars of values[group][series] in `box` = (x, y, width, height); None = no bar.

    Bars start at zero and share one linear scale; each is labelled with its value.
    """
    x, y, width, height = box
    canvas.text(x, y, title)
    top, bottom = y + 24, y + height - 14
    finite = [v for row in values for v in row if v is not None]
    peak = max(finite, default=0.0) or 1.0
    canvas.fill(x, bottom, x + width, bottom + 1, GREY)
    group_width = width / max(1, len(groups))
    for g, (group, row) in enumerate(zip(groups, values, strict=True)):
        left = x + g * group_width + 6
        bar = (group_width - 12) / max(1, len(row))
        for s, value in enumerate(row):
            if value is None:
                canvas.text(int(left + s * bar), bottom - 9, "-", GREY)
                continue
            bar_top = bottom - (bottom - top) * value / peak
            color = PALETTE[s % len(PALETTE)]
            canvas.fill(left + s * bar, bar_top, left + (s + 1) * bar - 2, bottom, color)
            label = _short(value)
            if canvas.text_width(label) <= bar + 8:
                canvas.text(int(left + s * bar), int(bar_top) - 9, label, BLACK)
        canvas.text(int(left), bottom + 4, group)


def _short(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"
