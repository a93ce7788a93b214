"""What `ray-zep bench scale` (and `scale-replay`) print and draw: the table's columns and
the chart of tokens/s per GPU against GPUs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ray_zep.report.figures import save_figure
from ray_zep.report.text_table import Column

COLUMNS = (
    Column("GPUs", "gpus"),
    Column("data", "distribution"),
    Column("model", "model"),
    Column("tok/GPU", lambda r: f"{r.tokens_per_gpu // 1024}k"),
    Column("placement", "placement"),
    Column("L", "tokens_per_rank"),
    Column("work m/m", "work_mean", ".2f"),
    Column("worst", "work_worst", ".2f"),
    Column("level", "level", ".2f"),
    Column("rings@1", "rings_at_mean", ".2f"),
    Column("ring fill", "ring_fill", ".2f"),
    Column("x ideal", "step_over_ideal", ".2f"),
    Column("x bound", "step_over_bound", ".2f"),
    Column("imbal s", "imbalance_s", ".3f"),
    Column("kernels s", "split_kernels_s", ".3f"),
    Column("contend s", "contention_s", ".3f"),
    Column("xfer s", "transfers_s", ".3f"),
    Column("wait s", "waits_s", ".3f"),
    Column("recomp s", "recompute_s", ".3f"),
    Column("tok/s/GPU", "tokens_per_s_per_gpu", ".0f"),
    Column("inter GB", "inter_node_gb", ".1f"),
    Column("plan ms", "planner_ms", ".0f"),
    Column("plan max", "planner_ms_max", ".0f"),
    Column("call ms", "planner_ms_call", ".0f"),
    Column("mem GB", "peak_memory_gb", ".1f"),
    Column("ckpt", "checkpointing"),
    Column("fits", "fits"),
    Column("micro", "micro_batches"),
    Column("K/V room", lambda r: "model" if r.kv_room_mb is None else f"{r.kv_room_mb:g}"),
)


def draw_scale_chart(rows: list[Any], path: str | Path) -> Path | None:
    """Tokens/s per GPU against GPUs (planner ms for a plan-only run), one panel per
    (model, tokens per GPU, distribution), one line per placement. None when matplotlib
    is not installed."""
    simulated = any(r.tokens_per_s_per_gpu for r in rows)
    field, label = ("tokens_per_s_per_gpu", "tokens/s per GPU") if simulated else (
        "planner_ms", "plan_step ms")  # fmt: skip
    panels = list(dict.fromkeys((r.model, r.tokens_per_gpu, r.distribution) for r in rows))
    cols = min(4, len(panels))
    grid = math.ceil(len(panels) / cols)

    def draw(figure: Any, axes: Any) -> None:
        figure.suptitle(f"{'modelled ' if simulated else ''}{label} (cluster A)")
        for ax, (model, tokens, distribution) in zip(axes.flat, panels, strict=False):
            mine = [r for r in rows if (r.model, r.tokens_per_gpu, r.distribution)
                    == (model, tokens, distribution) and getattr(r, field)]  # fmt: skip
            for placement in dict.fromkeys(r.placement for r in mine):
                line = sorted((r.gpus, getattr(r, field)) for r in mine
                              if r.placement == placement)  # fmt: skip
                ax.plot(*zip(*line, strict=True), marker="o", label=placement)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{model}, {tokens // 1024}k/GPU, {distribution}", fontsize=9)
            ax.set_xlabel("GPUs")
            ax.set_ylabel(label)
        axes.flat[0].legend(fontsize=7)
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)

    return save_figure(path, draw, size=(3.6 * cols, 3.0 * grid), rows=grid, cols=cols)
