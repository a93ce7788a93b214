"""What every step of a ring item computes, for every member at once.

Ring step s of position p computes against source position (p - s) mod R
(`attention.schedule.step_segments`: step 0 causal blocks over the position's
own rows; later, the query and key slots the item's layout selects for a source
before or after the position, `ray_zep.partition.layout`), one call per sequence
at the rate of that block's length (`ComputeRates.attention_rate`).

Costed step by step this is R steps of R x S blocks. Where the rate has the
half-rate form (no measured curve for unmasked blocks), a block of q x k pairs
costs per_pair / rate_long x (q k + L_half sqrt(q k)), so summing it over the
sequences is two matrix products over every (position, source) pair at once,
which is what a thousand-member ring needs.

Shapes: R positions, S sequences of the item, C layout slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ray_zep.costmodel import ComputeRates
from ray_zep.partition.layout import Layout


def step_table(
    sizes_RSC: np.ndarray,
    layout: Layout,
    rates: ComputeRates,
    per_pair: float,
    backward: bool,
    autograd: bool,
    heads: int,
) -> np.ndarray:
    """Seconds of every (position, step) of a ring item (positions x steps).

    Args:
        sizes_RSC: tokens of each sequence in each slot of each position.
        layout: the item's layout.
        rates: the device's rates.
        per_pair: FLOPs of one (query, key) pair (backward factor included).
        backward: backward rates.
        autograd: the kernel is differentiated by autograd (whole-sequence
            placements): its curve, and none of the engine's per-row costs.
        heads: query heads per call (`ComputeRates.curve_heads`).
    """
    ring = sizes_RSC.shape[0]
    blocks = _Blocks.of(sizes_RSC, layout)
    args = (rates, per_pair, backward, autograd, heads)
    curve, scale = rates.rate_curve(False, backward, autograd, heads)
    if curve is not None or scale != 1.0:
        return np.stack([_step(blocks, s, *args) for s in range(ring)], axis=1)
    by_source = _by_source(blocks, *args)
    positions = np.arange(ring)
    source = (positions[:, None] - positions[None, :]) % ring
    table = np.take_along_axis(by_source, source, axis=1)
    table[:, 0] = _step(blocks, 0, *args)
    return table


@dataclass(frozen=True)
class _Blocks:
    """Tokens (R x S) of every position: all of them, and the query and key slots its
    layout selects against a source before it and after it."""

    whole: np.ndarray
    q_before: np.ndarray
    k_before: np.ndarray
    q_after: np.ndarray
    k_after: np.ndarray

    @classmethod
    def of(cls, sizes_RSC: np.ndarray, layout: Layout) -> _Blocks:
        picks = [layout.selected(sizes_RSC, before, keys)
                 for before in (True, False) for keys in (False, True)]  # fmt: skip
        return cls(sizes_RSC.sum(axis=2), *picks)


def _step(blocks: _Blocks, step, rates, per_pair, backward, autograd, heads) -> np.ndarray:
    """Every position's seconds of one step, block by block."""
    ring = blocks.whole.shape[0]
    positions = np.arange(ring)
    source = (positions - step) % ring
    if step == 0:
        q = k = blocks.whole
        flops, length, causal = per_pair * q * (q + 1) / 2, q, True
    else:
        before = (source < positions)[:, None]
        q = np.where(before, blocks.q_before, blocks.q_after)
        k = np.where(before, blocks.k_before[source], blocks.k_after[source])
        flops, length, causal = per_pair * q * k, np.sqrt(q * k), False
    used = (q > 0) & (k > 0)
    rate = rates.attention_rates(length, causal, backward, autograd, heads)
    seconds = np.where(used, flops / np.where(used, rate, 1.0), 0.0).sum(axis=1)
    if not autograd:  # the engine's accumulators and copies around its kernel
        seconds += np.where(used, q, 0.0).sum(axis=1) * rates.ring_row_seconds
    return np.where(used.any(axis=1), seconds + rates.call_overhead_s, 0.0)


def _by_source(blocks: _Blocks, rates, per_pair, backward, autograd, heads) -> np.ndarray:
    """Seconds of position p against source position j (positions x sources), unmasked
    blocks at the half-rate form: sums over sequences as matrix products."""

    def seconds_of(q: np.ndarray, k: np.ndarray) -> np.ndarray:
        rate = rates.attention_backward if backward else rates.attention_forward
        pairs = q @ k.T
        roots = np.sqrt(q) @ np.sqrt(k).T
        seconds = per_pair / rate * (pairs + rates.full_half_tokens * roots)
        if not autograd:
            seconds += (q @ (k > 0).T) * rates.ring_row_seconds
        calls = (q > 0).astype(np.float64) @ (k > 0).astype(np.float64).T
        return np.where(calls > 0, seconds + rates.call_overhead_s, 0.0)

    ring = blocks.whole.shape[0]
    earlier = np.arange(ring)[None, :] < np.arange(ring)[:, None]  # source before position
    before = seconds_of(blocks.q_before, blocks.k_before)
    return np.where(earlier, before, seconds_of(blocks.q_after, blocks.k_after))
