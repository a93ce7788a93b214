"""Attention slicing for the attention-MoE pipeline (FoldMoE §4.2, Alg. 1).

A rank's packed tokens (L of them, several sequences) are cut into d attention
slices that run one after another, each attending over the keys of its own
and earlier tokens of the same sequence. The MoE layer takes fixed micro-batches
of m = ceil(L/d) tokens from a FIFO token buffer, so micro-batch j can start
once the slices cover min((j+1)·m, L) tokens: the prefix constraint.

Cost of a slice (eq. 5, per sequence piece of l tokens whose context, itself
included, is c tokens): (4·D + 3·H)·l·c + 8·D²·l, D the model dim, H the heads.

Time-uniform slicing (Alg. 1): a quick-start first slice of m tokens, so the
first dispatch starts early, then slices whose modelled cost is as close as
possible to a target t̂, each at least as long as the prefix constraint needs.
The paper's t̂ (the token-by-token cost over d) leaves the last slice with the
remainder; here t̂ is then solved for by bisection so that the d-th slice ends
exactly at L with the same cost as the others.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BISECTION_STEPS = 40


@dataclass(frozen=True)
class SliceCost:
    """Eq.-5 cost of any token range of a packed stream.

    Args:
        lengths: the sequences of the stream, in order.
        dim: model dimension D.
        heads: attention heads H.
        causal: count each query's keys exactly (l·c - l(l-1)/2 pairs per piece)
            instead of eq. 5's l·c, for timing rather than slicing.
    """

    lengths: tuple[int, ...]
    dim: int
    heads: int
    causal: bool = False

    def _pairs(self, size, context):
        """Query-key pairs of a piece of `size` tokens whose context (itself included)
        is `context` tokens."""
        return size * context - (size * (size - 1) / 2 if self.causal else 0.0)

    def __post_init__(self) -> None:
        ends = np.cumsum(np.asarray(self.lengths, dtype=np.int64))
        object.__setattr__(self, "_ends", ends)
        object.__setattr__(self, "_starts", ends - np.asarray(self.lengths, dtype=np.int64))
        whole = self._pairs(np.asarray(self.lengths, dtype=float), np.asarray(self.lengths, float))
        object.__setattr__(self, "_squares", np.concatenate(([0.0], np.cumsum(whole))))

    @property
    def total_tokens(self) -> int:
        return int(self._ends[-1]) if len(self.lengths) else 0

    def __call__(self, start: int, ends: np.ndarray | int) -> np.ndarray:
        """Cost of the tokens [start, end) for every end (> start) in `ends`."""
        ends = np.asarray(ends, dtype=np.int64)
        first = int(np.searchsorted(self._ends, start, side="right"))
        last = np.searchsorted(self._ends, ends - 1, side="right")
        seq_start = self._starts[first]
        same = last == first
        # One piece: l = end - start, c = end - seq_start.
        within = self._pairs((ends - start).astype(float), (ends - seq_start).astype(float))
        # Several: the first sequence's tail, whole sequences between, the last one's head.
        tail = self._pairs(float(self._ends[first] - start), float(self._ends[first] - seq_start))
        middle = self._squares[last] - self._squares[first + 1]
        head_len = (ends - self._starts[last]).astype(float)
        head = self._pairs(head_len, head_len)
        pieces = np.where(same, within, tail + middle + head)
        return (4 * self.dim + 3 * self.heads) * pieces + 8.0 * self.dim**2 * (ends - start)

    def token_by_token(self) -> float:
        """Σ over tokens of FLOPs(1, context): the attention work with no slicing waste."""
        positions = np.concatenate([np.arange(1, n + 1, dtype=float) for n in self.lengths])
        linear = 8.0 * self.dim**2 * len(positions)
        return float((4 * self.dim + 3 * self.heads) * positions.sum() + linear)


def micro_batch_sizes(tokens: int, degree: int) -> list[int]:
    """The token buffer's d micro-batches: m = ceil(L/d) each, the rest in the last ones."""
    m = math.ceil(tokens / degree) if tokens else 0
    return [max(0, min(m, tokens - j * m)) for j in range(degree)]


def token_uniform_slices(tokens: int, degree: int) -> list[int]:
    """d slices of the micro-batch size (the token-uniform baseline)."""
    return micro_batch_sizes(tokens, degree)


def _greedy(cost: SliceCost, degree: int, target: float) -> list[int]:
    """Alg. 1 with target t̂: quick-start slice, then slices costing about t̂ each."""
    total = cost.total_tokens
    m = math.ceil(total / degree)
    slices = [min(m, total)]
    start = slices[0]
    while len(slices) < degree:
        k = len(slices)
        lo = max(start + 1, min(total, (k + 1) * m))
        hi = total - (degree - k - 1)
        if k == degree - 1 or start >= total:
            end = total
        elif hi <= lo:
            end = min(lo, total)
        else:
            candidates = np.arange(lo, hi + 1)
            end = int(candidates[np.argmin(np.abs(cost(start, candidates) - target))])
        slices.append(end - start)
        start = end
    return slices


def time_uniform_slices(lengths: Sequence[int], degree: int, dim: int, heads: int) -> list[int]:
    """Quick-start time-uniform slicing of a packed stream into `degree` slices.

    Returns:
        d slice lengths summing to L that meet the prefix constraint of the
        token buffer; the last ones may be empty when the constraint's
        m-token steps use the tokens up early (short streams).
    """
    cost = SliceCost(tuple(int(n) for n in lengths), dim, heads)
    total = cost.total_tokens
    if degree == 1 or total <= degree:
        return token_uniform_slices(total, degree)
    lo, hi = 0.0, float(cost(0, total))
    best = _greedy(cost, degree, cost.token_by_token() / degree)
    for _ in range(BISECTION_STEPS):
        target = (lo + hi) / 2
        slices = _greedy(cost, degree, target)
        last = float(cost(total - slices[-1], total)) if slices[-1] else 0.0
        if last > target:
            lo = target  # the last slice got the remainder: aim higher
        else:
            hi = target
        best = slices
    return best


def slice_costs(
    lengths: Sequence[int], slices: Sequence[int], dim: int, heads: int, causal: bool = False
) -> list[float]:
    """Modelled cost of each slice (eq. 5, or exact causal FLOPs with `causal`)."""
    cost = SliceCost(tuple(int(n) for n in lengths), dim, heads, causal)
    bounds = np.cumsum([0, *slices])
    return [float(cost(int(a), int(b))) if b > a else 0.0 for a, b in itertools.pairwise(bounds)]
