"""A step's memory, measured (the model is `ray_zep.parallel.memory`).

On GPU the measurement is the caching allocator's peak of the step
(`torch.cuda.max_memory_allocated`, reset before the step). On CPU there is no
allocator counter; torch's `MemTracker` (a dispatch mode that follows every
tensor storage the step creates or frees, by category) gives the peak bytes of
live tensors, on the steps `metrics.memory_every` picks. Tensors created by
other threads (the routing relay) are not seen. Weight passing (`tawpipe`,
`ring_relay`) runs a shard's modules twice in a step, forward and again in
backward, which MemTracker cannot follow: there the state peak alone is measured.

The state peak (parameters + gradients + optimizer state) is sampled after every
operation the step dispatches, from the tensors themselves: the optimizer's
parameters, their gradients and its state, and whatever parameters the model has
registered at that moment (FSDP2's gathered ones between a unit's all-gather and
its reshard) with their gradients (a unit's unsharded ones until its
reduce-scatter). MemTracker's categories would miss those: it tags parameters at
module boundaries, and a unit that is a single projection has none inside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def _categories() -> dict:
    """MemTracker's categories in the model's terms (TEMP: backward's transient tensors).

    torch's memory tracker imports its compiler (half a second in every process), so only
    a measured CPU step imports it."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    return {
        _MemRefType.PARAM: "params",
        _MemRefType.GRAD: "grads",
        _MemRefType.OPT: "optimizer",
        _MemRefType.ACT: "activations",
        _MemRefType.TEMP: "activations",
        _MemRefType.BUFFER: "buffers",
        _MemRefType.OTH: "buffers",
    }


@dataclass
class PeakProbe:
    """Measures the peak of the steps it is asked to, on this rank's device."""

    device: torch.device
    every: int
    modules: tuple = ()
    whole_step: bool = True
    """On CPU, measure every live tensor (MemTracker); False: the state peak only."""
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
        sampler = StateSampler(*self.modules)
        if not self.whole_step:
            with sampler:
                yield
            self.last = {"state_peak": float(sampler.peak)}
            return
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(*self.modules)
        with tracker, sampler:
            yield
        peak = tracker.get_tracker_snapshot("peak").get(self.device, {})
        categories = _categories()
        parts = dict.fromkeys(categories.values(), 0.0)
        for kind, name in categories.items():
            parts[name] += float(peak.get(kind, 0))
        total = float(peak.get("Total", sum(parts.values())))
        self.last = {"peak": total, **parts, "state_peak": float(sampler.peak)}


class StateSampler(TorchDispatchMode):
    """The most bytes of parameters, gradients and optimizer state held after any
    operation run inside it (`peak`)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        self.module, self.optimizer = module, optimizer
        self.owned = [p for group in optimizer.param_groups for p in group["params"]]
        self.peak = self.current()

    def current(self) -> int:
        """Bytes of the distinct storages of the state tensors, now (the module's
        registered parameters change as FSDP2 gathers and reshards)."""
        tensors = [*self.owned, *self.module.parameters()]
        tensors += [p.grad for p in tensors if p.grad is not None]
        tensors += [
            t
            for per_param in self.optimizer.state.values()
            for t in per_param.values()
            if isinstance(t, torch.Tensor)
        ]
        storages = {}
        for tensor in tensors:
            storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.current())
        return out
