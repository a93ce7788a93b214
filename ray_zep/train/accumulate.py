"""Gradient accumulation: several micro-batches, one optimizer step.

Each micro-batch's gradient arrives synchronised over the ranks and normalised by
its own label tokens (the runners' contract). The step's gradient is the mean
token loss over every micro-batch, so micro-batch m counts with weight
L_m / sum(L): the sum is kept in one buffer beside `.grad` and put back before the
clip and the optimizer step. One micro-batch takes none of this (no copy, the same
arithmetic as before).
"""

from __future__ import annotations

import torch


class GradientSum:
    """The weighted sum of the micro-batches' gradients of `params`."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self._sum: list[torch.Tensor | None] = [None] * len(params)

    def add(self, weight: float) -> None:
        """Add the gradients now in `.grad`, times `weight`."""
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if self._sum[i] is None:
                self._sum[i] = p.grad.detach() * weight
            else:
                self._sum[i].add_(p.grad.detach(), alpha=weight)

    def restore(self) -> None:
        """Put the sum in `.grad` (a parameter no micro-batch reached keeps none)."""
        for p, total in zip(self.params, self._sum, strict=True):
            p.grad = total
