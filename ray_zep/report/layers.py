"""What `ray-zep plan` shows of the routing and remapping layers for a plan.

NIC bytes are one layer's ring, all-gather and Ulysses traffic, forward and
backward, in bf16 (dK/dV in fp32), with and without routing; the remap is the
solver's transfer for the plan's token counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray_zep.model_shapes import ModelShape
from ray_zep.partition.plan import AttentionPlan
from ray_zep.remap.solver import RemapPlan, remap_token_bytes, solve_remap
from ray_zep.report.text_table import Column, render_table
from ray_zep.traffic import Traffic, collective_traffic, ring_traffic

NIC_COLUMNS = (
    Column("node", "node"),
    Column("NIC", "nic"),
    Column("direct MB", "direct", ".2f", scale=1e6),
    Column("routed MB", "routed", ".2f", scale=1e6),
)


@dataclass
class LayerReport:
    """NIC traffic of one layer with and without routing, and the remap of the plan."""

    direct: Traffic
    routed: Traffic
    remap: RemapPlan

    @classmethod
    def build(cls, plan: AttentionPlan, shape: ModelShape) -> LayerReport:
        collectives = collective_traffic(plan, shape)
        return cls(
            ring_traffic(plan, shape, routed=False) + collectives,
            ring_traffic(plan, shape, routed=True) + collectives,
            solve_remap(plan.rank_tokens(), plan.topology, remap_token_bytes(shape)),
        )

    def busiest_ratio(self) -> float:
        """Bytes of the busiest NIC with routing over without (1.0 when nothing crosses)."""
        top = int(self.direct.nic.max())
        return float(self.routed.nic.max()) / top if top else 1.0

    def record(self) -> dict[str, Any]:
        return {
            "nic_bytes": {"direct": self.direct.to_dict(), "routed": self.routed.to_dict()},
            "remap": self.remap.to_dict(),
        }

    def table(self) -> str:
        nodes, nics = self.direct.nic.shape
        rows = [
            {
                "node": node,
                "nic": nic,
                "direct": float(self.direct.nic[node, nic]),
                "routed": float(self.routed.nic[node, nic]),
            }
            for node in range(nodes)
            for nic in range(nics)
        ]
        lines = [render_table(rows, NIC_COLUMNS)]
        lines.append(
            f"per layer (fwd+bwd): busiest NIC {self.direct.nic.max() / 1e6:.2f} MB direct, "
            f"{self.routed.nic.max() / 1e6:.2f} MB routed ({self.busiest_ratio():.2f}x); "
            f"intra-node {self.direct.intra_node / 1e6:.2f} MB direct, "
            f"{self.routed.intra_node / 1e6:.2f} MB routed"
        )
        remap = self.remap
        lines.append(
            f"remap: {remap.moved_tokens()} tokens in {len(remap.transfers)} transfers "
            f"to {min(remap.counts_after)}-{max(remap.counts_after)} tokens per rank; "
            f"max rank cost {remap.max_rank_cost * 1e6:.1f} us; solved in "
            f"{remap.solve_seconds * 1e3:.2f} ms"
        )
        return "\n".join(lines)
