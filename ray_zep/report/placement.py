"""What `ray-zep plan` shows: a per-rank table, a JSON record and a PNG of a plan."""

from __future__ import annotations

import math
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

from ray_zep.partition.level_trace import LevelTry, level_sentence
from ray_zep.partition.plan import AttentionPlan, Zone
from ray_zep.partition.stats import PlanStats
from ray_zep.report.figures import save_figure
from ray_zep.report.text_table import Column, render_table
from ray_zep.sim.outlier_choice import SPAN_NODES
from ray_zep.topology import LinkKind

Color = tuple[int, int, int]
"""Red, green, blue in 0..255."""

ZONE_COLORS: dict[Zone, tuple[Color, Color]] = {
    Zone.INTER_NODE: ((200, 60, 50), (235, 130, 110)),
    Zone.INTRA_NODE: ((225, 150, 30), (245, 200, 110)),
    Zone.LOCAL: ((60, 140, 80), (130, 195, 140)),
}
"""Two shades per zone, alternating between neighbouring sequences."""

ZONE_LABELS = {Zone.INTER_NODE: "inter", Zone.INTRA_NODE: "intra", Zone.LOCAL: "local"}


def plan_record(plan: AttentionPlan, stats: PlanStats) -> dict[str, Any]:
    """The JSON record of a plan: timing, then each rank's tokens, FLOPs and fragments.

    Fragments are the rank's tokens as half-open ranges [start, end) of the
    batch's sequences, in the order the rank holds them.
    """
    ranks = []
    for rank in range(plan.world):
        ranks.append(
            {
                "rank": rank,
                "node": plan.topology.node_of(rank),
                "tokens": int(stats.tokens[rank]),
                "attention_flops": float(stats.attention_flops[rank]),
                "work_flops": float(stats.work_flops[rank]),
                "modelled_ms": float(stats.seconds[rank] * 1e3),
                "sent_bytes": {k.value: int(stats.sent_bytes[k][rank]) for k in LinkKind},
                "fragments": [
                    {"seq": f.seq, "start": f.start, "end": f.end, "zone": f.zone.value}
                    for f in plan.layout(rank)
                ],
            }
        )
    return {
        "placement": plan.planner.value,
        "planner_ms": plan.planner_seconds * 1e3,
        "tokens_per_rank": plan.tokens_per_rank,
        "nodes": plan.topology.nodes,
        "gpus_per_node": plan.topology.gpus_per_node,
        "lengths": plan.lengths.tolist(),
        "modelled_layer_ms": stats.layer_seconds * 1e3,
        "work_max_over_mean": stats.work_imbalance(),
        "levels": [_level_record(t) for t in plan.levels],
        "ranks": ranks,
    }


RANK_COLUMNS = (
    Column("rank", "rank"),
    Column("node", "node"),
    Column("tokens", "tokens"),
    Column("of L", "of_l", ".2f"),
    Column("attn GFLOP", "attention_flops", ".2f", scale=1e9),
    Column("model ms", "ms", ".3f"),
    Column("intra MB", "intra_bytes", ".1f", scale=1e6),
    Column("inter MB", "inter_bytes", ".1f", scale=1e6),
    Column("zones (tokens)", "zones"),
)


def rank_table(plan: AttentionPlan, stats: PlanStats) -> str:
    """One line per rank, then a summary line."""
    rows = [_rank_row(plan, stats, rank) for rank in range(plan.world)]
    return render_table(rows, RANK_COLUMNS) + "\n" + summary_line(plan, stats)


def _rank_row(plan: AttentionPlan, stats: PlanStats, rank: int) -> dict[str, Any]:
    zones = ", ".join(
        f"{ZONE_LABELS[zone]} {stats.zones[rank][zone.value]}"
        for zone in ZONE_LABELS
        if stats.zones[rank].get(zone.value)
    )
    return {
        "rank": rank,
        "node": plan.topology.node_of(rank),
        "tokens": int(stats.tokens[rank]),
        "of_l": float(stats.tokens[rank] / plan.tokens_per_rank),
        "attention_flops": float(stats.attention_flops[rank]),
        "ms": float(stats.seconds[rank] * 1e3),
        "intra_bytes": float(stats.sent_bytes[LinkKind.INTRA_NODE][rank]),
        "inter_bytes": float(stats.sent_bytes[LinkKind.INTER_NODE][rank]),
        "zones": zones or None,
    }


TOKEN_BOUND_FILL = 0.95
TOKEN_BOUND_WORK = 0.8
"""A rank holding at least this share of L at under this share of the mean work is
token-bound (`token_bound_ranks`)."""


def token_bound_ranks(plan: AttentionPlan, stats: PlanStats) -> int:
    """Ranks whose tokens are nearly L while their work (`PlanStats.work_flops`) is well
    under the mean: documents that need ranks for their tokens, not their work, which
    leave the other ranks more work than the mean (`ray_zep.sim.token_room`)."""
    mean = float(stats.work_flops.mean())
    if mean <= 0:
        return 0
    full = stats.tokens >= TOKEN_BOUND_FILL * plan.tokens_per_rank
    light = stats.work_flops < TOKEN_BOUND_WORK * mean
    return int((full & light).sum())


def outlier_on_busiest(plan: AttentionPlan, stats: PlanStats) -> tuple[int, int, int] | None:
    """(the busiest rank by work, the longest sequence it holds a piece of that is longer
    than `SPAN_NODES` nodes' tokens (G x L each), the nodes its group spans); None
    where it holds none: its group's floor (K/V imported over the NICs whatever its
    width) may set the step, which outlier delay pays once for several such documents
    (`ray_zep.sim.outlier_choice`)."""
    if stats.work_flops.size == 0:
        return None
    busiest = int(stats.work_flops.argmax())
    topology = plan.topology
    threshold = SPAN_NODES * topology.gpus_per_node * plan.tokens_per_rank
    held = [p for p in plan.placements if p.length >= threshold and busiest in p.ranks]
    if not held:
        return None
    longest = max(held, key=lambda p: p.length)
    nodes = len({topology.node_of(r) for r in longest.ranks})
    return busiest, int(longest.length), nodes


def _level_record(tried: LevelTry) -> dict[str, Any]:
    """One level the planner tried, for the JSON record (`busiest` null where not placed,
    nor abandoned at a known bound: `LevelTry.busiest`)."""
    busiest = None if math.isnan(tried.busiest) else tried.busiest
    fill = None if math.isnan(tried.ring_fill) else tried.ring_fill
    return {"factor": tried.factor, "outcome": tried.outcome.value, "busiest": busiest,
            "ranks": tried.ranks or None, "ring_ranks": tried.ring_ranks or None,
            "ring_fill": fill}  # fmt: skip


def summary_line(plan: AttentionPlan, stats: PlanStats) -> str:
    rings = [item for item in plan.items() if item.ring_size > 1 and item.exchange_kind.rotates]
    kept = sum(item.exchange_kind.keeps_kv for item in rings)
    keeping = f"; {kept} of {len(rings)} rings keep their K/V for the backward" if rings else ""
    in_rings = Counter(r for item in plan.items() if len(item.ranks) > 1 for r in item.ranks)
    several = sum(count > 1 for count in in_rings.values())
    if several:  # hosted rings (`ray_zep.partition.hosting`) or the cost policy's splits
        keeping += f"; {several} ranks sit in more than one ring"
    shared = [item for item in plan.items() if item.ulysses > 1 and len(item.seqs) > 1]
    if shared:  # guests (`ray_zep.partition.usp_guests`)
        guests = sum(len(item.seqs) - 1 for item in shared)
        keeping += f"; {len(shared)} USP groups hold {guests} more sequences as guests"
    bound = token_bound_ranks(plan, stats)
    if bound:
        keeping += (
            f"; {bound} ranks hold {TOKEN_BOUND_FILL:.0%} of L or more at under "
            f"{TOKEN_BOUND_WORK}x the mean work (their sequences need them for their tokens: "
            "more L for the same batch may even the work out, `ray-zep plan --auto` plays it)"
        )
    outlier = outlier_on_busiest(plan, stats)
    if outlier:
        rank, length, nodes = outlier
        keeping += (
            f"; the busiest rank (R{rank}) holds part of a {length:,}-token sequence over "
            f"{nodes} nodes, longer than {SPAN_NODES} nodes' L: an outlier whose group "
            "may set the step (`data.outlier_tokens` holds such documents back to train "
            "them together, which `ray-zep plan --auto` plays on the configured data)"
        )
    levels = level_sentence(plan.levels, plan.world)
    if levels:
        keeping += f"; {levels}"
    return (
        f"{plan.planner.value}: {len(plan.placements)} sequences, {int(stats.tokens.sum())} tokens "
        f"on {plan.world} ranks; planner {plan.planner_seconds * 1e3:.2f} ms; work (linear + "
        f"attention FLOPs) max/mean {stats.work_imbalance():.2f}, attention FLOPs max/mean "
        f"{stats.imbalance():.2f}; max tokens/L "
        f"{stats.tokens.max() / plan.tokens_per_rank:.2f}; inter-node "
        f"{stats.total_bytes(LinkKind.INTER_NODE) / 1e9:.3f} GB, intra-node "
        f"{stats.total_bytes(LinkKind.INTRA_NODE) / 1e9:.3f} GB per layer forward; "
        f"modelled attention {stats.layer_seconds * 1e3:.2f} ms per layer forward{keeping}"
    )


def draw_placement(plan: AttentionPlan, stats: PlanStats, path: str | Path) -> Path | None:
    """PNG of every rank's tokens: one bar per rank over [0, L), one block per fragment.

    Blocks are coloured by zone, in two shades alternating between sequences;
    dashed lines separate nodes.

    Returns:
        `path`, or None when matplotlib is not installed (the picture is skipped).
    """
    height = 1.6 + 0.24 * plan.world
    return save_figure(path, partial(_draw_placement, plan, stats), size=(11.0, height))


def _draw_placement(plan: AttentionPlan, stats: PlanStats, figure: Any, axes: Any) -> None:
    from matplotlib.patches import Patch

    ax = axes[0, 0]
    for rank in range(plan.world):
        blocks, colors, offset = [], [], 0
        for fragment in plan.layout(rank):
            blocks.append((offset, fragment.length))
            colors.append(_rgb(ZONE_COLORS[fragment.zone][fragment.seq % 2]))
            offset += fragment.length
        ax.broken_barh(blocks, (rank - 0.4, 0.8), facecolors=colors)
        if rank and plan.topology.local_index(rank) == 0:
            ax.axhline(rank - 0.5, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlim(0, plan.tokens_per_rank)
    ax.set_ylim(plan.world - 0.5, -0.5)
    ax.set_yticks(range(plan.world), [f"R{r}" for r in range(plan.world)], fontsize=7)
    ax.set_xlabel(f"position in the rank's share (tokens, L = {plan.tokens_per_rank})")
    ax.set_ylabel("rank (dashed: node boundary)")
    ax.set_title(summary_title(plan, stats), fontsize=9)
    handles = [
        Patch(color=_rgb(shade), label=ZONE_LABELS[zone] + " node" * (zone != Zone.LOCAL))
        for zone, (shade, _) in ZONE_COLORS.items()
    ]
    ax.legend(handles=handles, loc="upper right", fontsize=8, ncols=len(handles))


def _rgb(color: Color) -> tuple[float, float, float]:
    return (color[0] / 255, color[1] / 255, color[2] / 255)


def summary_title(plan: AttentionPlan, stats: PlanStats) -> str:
    return (
        f"{plan.planner.value}  {len(plan.placements)} seqs  {int(stats.tokens.sum())} tokens  "
        f"L={plan.tokens_per_rank}  planner {plan.planner_seconds * 1e3:.2f} ms  "
        f"flops max/mean {stats.imbalance():.2f}"
    )
