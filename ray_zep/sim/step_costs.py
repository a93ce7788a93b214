"""What every step of a ring item computes, for every member at once.

Ring step s of position p computes against source position (p - s) mod R
(`attention.schedule.step_segments`: step 0 causal blocks over the position's
own rows; later, all its rows against the source's early chunks when the source
comes before it, else its late rows against all the source's rows), one call
per sequence at the rate of that block's length (`ComputeRates.attention_rate`).

Costed step by step this is R steps of R x S blocks. Where the rate has the
half-rate form (no measured curve for unmasked blocks), a block of q x k pairs
costs per_pair / rate_long x (q k + L_half sqrt(q k)), so summing it over the
sequences is two matrix products over every (position, source) pair at once,
which is what a thousand-member ring needs.

Shapes: R positions, S sequences of the item.
"""

from __future__ import annotations

import numpy as np

from ray_zep.costmodel import ComputeRates


def step_table(
    early_RS: np.ndarray,
    late_RS: np.ndarray,
    rates: ComputeRates,
    per_pair: float,
    backward: bool,
    autograd: bool,
    heads: int,
) -> np.ndarray:
    """Seconds of every (position, step) of a ring item (positions x steps).

    Args:
        early_RS, late_RS: tokens of each sequence in each position's early and late
            zigzag chunk.
        rates: the device's rates.
        per_pair: FLOPs of one (query, key) pair (backward factor included).
        backward: backward rates.
        autograd: the kernel is differentiated by autograd (whole-sequence
            placements): its curve, and none of the engine's per-row costs.
        heads: query heads per call (`ComputeRates.curve_heads`).
    """
    ring = early_RS.shape[0]
    args = (rates, per_pair, backward, autograd, heads)
    curve, scale = rates.rate_curve(False, backward, autograd, heads)
    if curve is not None or scale != 1.0:
        return np.stack([_step(early_RS, late_RS, s, *args) for s in range(ring)], axis=1)
    by_source = _by_source(early_RS, late_RS, *args)
    positions = np.arange(ring)
    source = (positions[:, None] - positions[None, :]) % ring
    table = np.take_along_axis(by_source, source, axis=1)
    table[:, 0] = _step(early_RS, late_RS, 0, *args)
    return table


def _step(early, late, step, rates, per_pair, backward, autograd, heads) -> np.ndarray:
    """Every position's seconds of one step, block by block."""
    ring = early.shape[0]
    positions = np.arange(ring)
    source = (positions - step) % ring
    if step == 0:
        q = k = early + late
        flops, length, causal = per_pair * q * (q + 1) / 2, q, True
    else:
        before = (source < positions)[:, None]
        q = np.where(before, early + late, late)
        k = np.where(before, early[source], early[source] + late[source])
        flops, length, causal = per_pair * q * k, np.sqrt(q * k), False
    used = (q > 0) & (k > 0)
    rate = rates.attention_rates(length, causal, backward, autograd, heads)
    seconds = np.where(used, flops / np.where(used, rate, 1.0), 0.0).sum(axis=1)
    if not autograd:  # the engine's accumulators and copies around its kernel
        seconds += np.where(used, q, 0.0).sum(axis=1) * rates.ring_row_seconds
    return np.where(used.any(axis=1), seconds + rates.call_overhead_s, 0.0)


def _by_source(early, late, rates, per_pair, backward, autograd, heads) -> np.ndarray:
    """Seconds of position p against source position j (positions x sources), unmasked
    blocks at the half-rate form: sums over sequences as matrix products."""
    whole = early + late

    def blocks(q: np.ndarray, k: np.ndarray) -> np.ndarray:
        rate = rates.attention_backward if backward else rates.attention_forward
        pairs = q @ k.T
        roots = np.sqrt(q) @ np.sqrt(k).T
        seconds = per_pair / rate * (pairs + rates.full_half_tokens * roots)
        if not autograd:
            seconds += (q @ (k > 0).T) * rates.ring_row_seconds
        calls = (q > 0).astype(np.float64) @ (k > 0).astype(np.float64).T
        return np.where(calls > 0, seconds + rates.call_overhead_s, 0.0)

    ring = early.shape[0]
    earlier = np.arange(ring)[None, :] < np.arange(ring)[:, None]  # source before position
    return np.where(earlier, blocks(whole, early), blocks(late, whole))
