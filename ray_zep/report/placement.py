"""What `ray-zep plan` shows: a per-rank table, a JSON record and a PNG of a plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray_zep.partition.plan import AttentionPlan, Zone
from ray_zep.partition.stats import PlanStats
from ray_zep.report.png import BLACK, GREY, Canvas, Color
from ray_zep.topology import LinkKind

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
        "ranks": ranks,
    }


def rank_table(plan: AttentionPlan, stats: PlanStats) -> str:
    """One line per rank, then a summary line."""
    header = (
        f"{'rank':>4} {'node':>4} {'tokens':>8} {'of L':>5} {'attn GFLOP':>10} "
        f"{'model ms':>8} {'intra MB':>8} {'inter MB':>8}  zones (tokens)"
    )
    lines = [header]
    capacity = plan.tokens_per_rank
    for rank in range(plan.world):
        zones = ", ".join(
            f"{ZONE_LABELS[zone]} {stats.zones[rank][zone.value]}"
            for zone in ZONE_LABELS
            if stats.zones[rank].get(zone.value)
        )
        lines.append(
            f"{rank:>4} {plan.topology.node_of(rank):>4} {int(stats.tokens[rank]):>8} "
            f"{stats.tokens[rank] / capacity:>5.2f} {stats.attention_flops[rank] / 1e9:>10.2f} "
            f"{stats.seconds[rank] * 1e3:>8.3f} "
            f"{stats.sent_bytes[LinkKind.INTRA_NODE][rank] / 1e6:>8.1f} "
            f"{stats.sent_bytes[LinkKind.INTER_NODE][rank] / 1e6:>8.1f}  {zones or '-'}"
        )
    lines.append(summary_line(plan, stats))
    return "\n".join(lines)


def summary_line(plan: AttentionPlan, stats: PlanStats) -> str:
    return (
        f"{plan.planner.value}: {len(plan.placements)} sequences, {int(stats.tokens.sum())} tokens "
        f"on {plan.world} ranks; planner {plan.planner_seconds * 1e3:.2f} ms; attention "
        f"FLOPs max/mean {stats.imbalance():.2f}; max tokens/L "
        f"{stats.tokens.max() / plan.tokens_per_rank:.2f}; inter-node "
        f"{stats.total_bytes(LinkKind.INTER_NODE) / 1e9:.3f} GB, intra-node "
        f"{stats.total_bytes(LinkKind.INTRA_NODE) / 1e9:.3f} GB per layer forward; "
        f"modelled attention {stats.layer_seconds * 1e3:.2f} ms per layer forward"
    )


def draw_placement(plan: AttentionPlan, stats: PlanStats, path: str | Path) -> Path:
    """PNG of every rank's tokens: one bar per rank over [0, L), one block per fragment.

    Blocks are coloured by zone, in two shades alternating between sequences;
    lines separate nodes.
    """
    row, gap, left, top, bar_width = 12, 3, 64, 44, 900
    height = top + plan.world * (row + gap) + plan.topology.nodes + 10
    canvas = Canvas(left + bar_width + 20, height)
    canvas.text(8, 6, summary_title(plan, stats), BLACK)
    x = 8
    for zone, (shade, _) in ZONE_COLORS.items():
        canvas.fill(x, 22, x + 10, 32, shade)
        x += 14 + canvas.text(x + 14, 24, ZONE_LABELS[zone] + " node" * (zone != Zone.LOCAL))
        x += 16
    scale = bar_width / plan.tokens_per_rank
    y = top
    for rank in range(plan.world):
        if rank and plan.topology.local_index(rank) == 0:
            canvas.fill(left, y - 2, left + bar_width, y - 1, GREY)
            y += 1
        canvas.text(8, y + 2, f"R{rank}")
        canvas.fill(left - 1, y, left, y + row, GREY)
        canvas.fill(left + bar_width, y, left + bar_width + 1, y + row, GREY)
        offset = 0
        for fragment in plan.layout(rank):
            shade = ZONE_COLORS[fragment.zone][fragment.seq % 2]
            x0 = left + offset * scale
            offset += fragment.length
            canvas.fill(x0, y, left + offset * scale, y + row, shade)
        y += row + gap
    return canvas.save(path)


def summary_title(plan: AttentionPlan, stats: PlanStats) -> str:
    return (
        f"{plan.planner.value}  {len(plan.placements)} seqs  {int(stats.tokens.sum())} tokens  "
        f"L={plan.tokens_per_rank}  planner {plan.planner_seconds * 1e3:.2f} ms  "
        f"flops max/mean {stats.imbalance():.2f}"
    )
