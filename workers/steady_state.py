"""What the timed benches share: the overrides of a timed run and its steady state."""

from __future__ import annotations

TIMING_OVERRIDES = ("metrics.memory_every=0",)
"""Timed runs measure no memory: on CPU a measured step runs 2-3x slower (MemTracker
follows every tensor), which would bias the steady-state step time."""
WARM_UP_STEPS = 2
"""Steps left out of the steady state: process groups, the first plans, the first
backward of each shape."""


def steady_totals(rows: list[dict], warm_up: int = WARM_UP_STEPS) -> tuple[float, int]:
    """Seconds and tokens of every step row after the first `warm_up`."""
    steady = rows[warm_up:]
    return sum(r["step_seconds"] for r in steady), sum(r["tokens"] for r in steady)
