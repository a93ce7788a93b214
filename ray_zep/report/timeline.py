"""Pictures of simulated steps: per-rank timelines (like the Zeppelin paper's Fig. 12)
and throughput bars (like its Fig. 8)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ray_zep.report.charts import bar_panel
from ray_zep.report.png import BLACK, GREY, Canvas, Color
from ray_zep.sim.events import Lane, Timeline

LANE_COLORS: dict[Lane, Color] = {
    Lane.COMPUTE: (60, 120, 190),
    Lane.INTRA_NODE: (60, 150, 80),
    Lane.INTER_NODE: (200, 60, 50),
}
LANE_HEIGHT, RANK_GAP, LEFT, WIDTH = 6, 5, 60, 1100


def draw_timelines(
    panels: Sequence[tuple[str, Timeline]], ranks: Sequence[int], path: Path
) -> Path:
    """One panel per (title, timeline): for each rank in `ranks`, its compute,
    intra-node and inter-node lanes on a common time axis per panel."""
    rank_height = 3 * LANE_HEIGHT + RANK_GAP
    panel_height = 40 + len(ranks) * rank_height
    canvas = Canvas(LEFT + WIDTH + 20, 30 + panel_height * len(panels))
    x = 10
    for lane, color in LANE_COLORS.items():
        canvas.fill(x, 8, x + 10, 18, color)
        x += 14 + canvas.text(x + 14, 10, lane.value.replace("_", "-")) + 14
    for index, (title, timeline) in enumerate(panels):
        top = 30 + index * panel_height
        span = timeline.makespan or 1.0
        canvas.text(10, top + 4, f"{title}: {span * 1e3:.2f} ms")
        for row, rank in enumerate(ranks):
            y = top + 20 + row * rank_height
            canvas.text(10, y + LANE_HEIGHT, f"r{rank}", GREY)
            for offset, lane in enumerate(LANE_COLORS):
                for start, end, _ in timeline.intervals(rank, lane):
                    x0 = LEFT + WIDTH * start / span
                    x1 = LEFT + WIDTH * end / span
                    lane_y = y + offset * LANE_HEIGHT
                    canvas.fill(x0, lane_y, x1, lane_y + LANE_HEIGHT - 1, LANE_COLORS[lane])
        canvas.fill(LEFT, top + panel_height - 12, LEFT + WIDTH, top + panel_height - 11, BLACK)
    return canvas.save(path)


def draw_throughput(
    title: str, names: Sequence[str], tokens_per_second: Sequence[float | None], path: Path
) -> Path:
    """Bars of simulated tokens/s (thousands) per strategy."""
    canvas = Canvas(max(420, 110 * len(names)), 300)
    values = [[None if v is None else v / 1e3] for v in tokens_per_second]
    bar_panel(canvas, (10, 10, canvas.width - 20, 250), f"{title} (k tokens/s)", names, values)
    return canvas.save(path)
