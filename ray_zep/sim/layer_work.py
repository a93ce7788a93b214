"""The per-token work of a layer's linear parts: their share of the layer's element-wise
work, and what activation checkpointing makes a block's backward compute again.

`selective` recomputes the feed-forward part's forward (its matmuls and SwiGLU);
`linears` every projection's forward and the forward's element-wise work (norms, RoPE,
SwiGLU), not the attention: the output projection and the feed-forward as the block's
backward starts, the q/k/v projections before their own backward. Both are local to a
rank (no transfer), so each rank recomputes its own linear-layout tokens inside its
backward (`ray_zep.sim.program`); `full` plays the whole forward layer again, ring
exchange included (`ray_zep.sim.step`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_zep.costmodel import ComputeRates, linear_flops_per_token, pointwise_elements_per_token
from ray_zep.model_shapes import ModelShape
from ray_zep.options import ActivationCheckpointing

POINTWISE_SHARES = ((1 / 6, 1 / 6), (1 / 3, 1 / 3))
"""Shares of a layer's element-wise work (forward and backward together) each linear
part takes: (before attention, after it), forward then backward (backward: twice)."""
RECOMPUTED_IN_BACKWARD = (ActivationCheckpointing.SELECTIVE, ActivationCheckpointing.LINEARS)
"""The modes whose recomputation is local work inside the block's backward
(`recomputed_parts`)."""
SWIGLU_FORWARD_PASSES = 3
"""Passes over the feed-forward width of SwiGLU's forward: two inputs read, one output
written (the element-wise model counts 6 for forward and backward)."""


def linear_part_seconds(
    tokens: float,
    flops_per_token: float,
    elements_per_token: float,
    rates: ComputeRates,
    matmul_factor: float = 1.0,
) -> float:
    """A linear part alone over `tokens` tokens: its matmuls (`matmul_factor`: the
    backward's multiple of the forward's FLOPs) and its element-wise work."""
    matmul = matmul_factor * tokens * flops_per_token / rates.matmul
    return matmul + rates.pointwise_seconds(tokens * elements_per_token)


@dataclass(frozen=True)
class RecomputedPart:
    """A part of a block's forward that its backward computes again."""

    flops_per_token: float
    """Matmul FLOPs per linear-layout token."""
    elements_per_token: float
    """Element-wise work per token, in the element-wise model's elements."""
    name: str

    def seconds(self, tokens: float, rates: ComputeRates) -> float:
        """The part over `tokens` tokens at `rates`."""
        return linear_part_seconds(tokens, self.flops_per_token, self.elements_per_token, rates)


def recomputed_parts(
    shape: ModelShape, mode: ActivationCheckpointing
) -> tuple[RecomputedPart | None, RecomputedPart | None]:
    """What a block's backward under `mode` recomputes on its own rank: (as its backward
    starts, before its q/k/v projections' backward); None where nothing (`none`, and
    `full`, whose recomputation replays the whole forward layer instead)."""
    if mode is ActivationCheckpointing.SELECTIVE:
        width = shape.mean_ffn_params() / (3 * shape.dim)  # SwiGLU width, MoE blocks averaged
        ffn = RecomputedPart(2.0 * shape.mean_ffn_params(), SWIGLU_FORWARD_PASSES * width,
                             "recompute the feed-forward")  # fmt: skip
        return ffn, None
    if mode is ActivationCheckpointing.LINEARS:
        before, after = linear_flops_per_token(shape)
        elements = pointwise_elements_per_token(shape)
        (share_before, share_after), _ = POINTWISE_SHARES
        return (
            RecomputedPart(after, share_after * elements, "recompute output projection + MLP"),
            RecomputedPart(before, share_before * elements, "recompute QKV projection"),
        )
    return None, None


def recomputed_seconds(
    shape: ModelShape, mode: ActivationCheckpointing, tokens: float, rates: ComputeRates
) -> float:
    """What one block's backward under `mode` recomputes over `tokens` on its own rank."""
    parts = recomputed_parts(shape, mode)
    return sum(part.seconds(tokens, rates) for part in parts if part is not None)
