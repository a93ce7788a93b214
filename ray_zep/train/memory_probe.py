"""A step's memory, measured (the model is `ray_zep.parallel.memory`).

On GPU the measurement is the caching allocator's peak of the step
(`torch.cuda.max_memory_allocated`, reset before the step). On CPU there is no
allocator counter; torch's `MemTracker` (a dispatch mode that follows every
tensor storage the step creates or frees, by category) gives the peak bytes of
live tensors, on the steps `metrics.memory_every` picks. Tensors created by
other threads (the routing relay) are not seen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

CATEGORIES = {
    _MemRefType.PARAM: "params",
    _MemRefType.GRAD: "grads",
    _MemRefType.OPT: "optimizer",
    _MemRefType.ACT: "activations",
    _MemRefType.TEMP: "activations",
    _MemRefType.BUFFER: "buffers",
    _MemRefType.OTH: "buffers",
}
"""MemTracker's categories in the model's terms (TEMP: backward's transient tensors)."""


@dataclass
class PeakProbe:
    """Measures the peak of the steps it is asked to, on this rank's device."""

    device: torch.device
    every: int
    modules: tuple = ()
    last: dict[str, float] = field(default_factory=dict)
    """The last measured step: `peak` bytes, on CPU with its parts at that moment and
    `state_peak` (the most parameters + gradients + optimizer state held); empty if the
    step was not measured."""

    @property
    def method(self) -> str:
        return "cuda.max_memory_allocated" if self.device.type == "cuda" else "MemTracker"

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Measure the step numbered `step` (1-based) if it is one to measure."""
        self.last = {}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            self.last = {"peak": float(torch.cuda.max_memory_allocated(self.device))}
            return
        if not self.every or step < 2 or (step - 2) % self.every:
            yield
            return
        tracker = MemTracker()
        tracker.track_external(*self.modules)
        with tracker:
            yield
        peak = tracker.get_tracker_snapshot("peak").get(self.device, {})
        parts = dict.fromkeys(CATEGORIES.values(), 0.0)
        for kind, name in CATEGORIES.items():
            parts[name] += float(peak.get(kind, 0))
        total = float(peak.get("Total", sum(parts.values())))
        self.last = {"peak": total, **parts, "state_peak": self._state_peak(tracker)}

    def _state_peak(self, tracker: MemTracker) -> float:
        """The largest parameters + gradients + optimizer state the step held, sampled
        before and after every module's forward and backward and at the step's end."""
        snapshots = [tracker.get_tracker_snapshot("current")]
        for stats in tracker.memory_tracking.values():
            for taken in stats.snapshots.values():
                snapshots.extend(taken)
        state = (_MemRefType.PARAM, _MemRefType.GRAD, _MemRefType.OPT)
        return max(
            float(sum(snap.get(self.device, {}).get(kind, 0) for kind in state))
            for snap in snapshots
        )
