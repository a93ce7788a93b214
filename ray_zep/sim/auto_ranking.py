"""`ray-zep plan --auto`'s candidates and their ranking (`ray_zep.sim.auto` searches them).

A candidate is one composition with what the simulator says of it: its steps on the
batches it was played on, the fullest rank's modelled memory, whether it fits, its bounds,
and where it derives from another candidate (more token room, outlier delay) what that
buys. The ranking puts first the fastest that fits and trains the config's documents
whole; the verdict says where the winner gains over the runner-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ray_zep.config import Compression, Config, MoEPipeline
from ray_zep.model_shapes import build_shape
from ray_zep.options import ActivationCheckpointing
from ray_zep.partition.registry import spec_of
from ray_zep.sim.checkpointing import checkpointing_label
from ray_zep.sim.outlier_choice import DelayEffect
from ray_zep.sim.step import StepResult

TIE = 1.001
"""Steps within this factor of the winner's are as fast: the runner-up is the first slower."""


@dataclass
class Candidate:
    """One composition and what the simulator says of it.

    Attributes:
        config: the run with this composition.
        steps: simulated steps of the batches (empty when it cannot place them).
        memory_gb: modelled memory of the fullest rank, GB.
        fits: every rank fits the GPU's memory (always, when the topology names none).
        error: why it cannot run these batches.
        bounds: each batch's step bound under this composition's weights mode
            (`ray_zep.sim.bound`).
    """

    config: Config
    steps: list[StepResult] = field(default_factory=list)
    memory_gb: float = 0.0
    fits: bool = True
    error: str | None = None
    bounds: list[float] = field(default_factory=list)
    room_of: Candidate | None = None
    """The candidate this one plays with a larger L for the same batches
    (`ray_zep.sim.token_room`); the name then shows L."""
    delay_of: Candidate | None = None
    """The candidate this one plays with outlier delay (`ray_zep.sim.outlier_choice`)."""
    delay: DelayEffect | None = None
    """What the delay does on its window, against `delay_of`'s composition without it:
    the candidate's step is `delay_of`'s times its ratio (`steps` are the window's)."""
    cut_at: int | None = None
    """Where its data actor cuts documents the config trains longer (the longest sequence
    its packing takes, e.g. L for rank-packed whole sequences): it trains a shorter
    context than the config asks for, so it ranks after every composition that does not."""

    @property
    def over_bound(self) -> float | None:
        """The mean step over the mean bound of the batches."""
        if not self.steps or len(self.bounds) != len(self.steps):
            return None
        return float(np.mean([s.step_seconds for s in self.steps]) / np.mean(self.bounds))

    @property
    def name(self) -> str:
        p = self.config.parallel
        parts = [p.sequence.value, p.weights.value]
        if p.routing:
            parts.append("routing")
        if p.remap:
            parts.append("remap")
        if spec_of(p.sequence).zone_policies:
            parts.append(f"zones={p.zone_policy.value}")
        if p.ep > 1:
            parts.append(f"ep={p.ep}")
        if p.moe_pipeline is not MoEPipeline.NONE:
            parts.append(f"moe_pipeline={p.moe_pipeline.value}")
        if p.shard_nodes:
            parts.append(f"shard_nodes={p.shard_nodes}")
        if p.ring_kv_room_mb is not None:
            parts.append(f"ring_kv_room_mb={p.ring_kv_room_mb:g}")
        if self.config.comm.compression is not Compression.OFF:
            parts.append(f"compression={self.config.comm.compression.value}")
        if self.config.train.activation_checkpointing is not ActivationCheckpointing.NONE:
            label = checkpointing_label(self.config, build_shape(self.config.model))
            parts.append(f"checkpointing={label.replace(' ', ':')}")
        if self.config.train.micro_batches > 1:
            parts.append(f"micro_batches={self.config.train.micro_batches}")
        if self.room_of is not None or self.config.train.micro_batches > 1:
            parts.append(f"L={self.config.train.tokens_per_rank}")
        if self.config.data.outlier_tokens > 0:
            parts.append(f"outlier_tokens={self.config.data.outlier_tokens}")
        return "+".join(parts)

    @property
    def switches_on(self) -> int:
        """Routing, remap, the MoE pipeline and compression switched on: of equally fast
        candidates the simplest ranks first."""
        p = self.config.parallel
        on = (p.routing, p.remap, p.moe_pipeline is not MoEPipeline.NONE,
              self.config.comm.compression is not Compression.OFF)  # fmt: skip
        return sum(on)

    @property
    def step_seconds(self) -> float:
        """The mean simulated step; with `delay`, `delay_of`'s times the delay's ratio (its
        own steps are another window's)."""
        if not self.steps:
            return float("inf")
        if self.delay is not None and self.delay_of is not None:
            return self.delay_of.step_seconds * self.delay.ratio
        return float(np.mean([s.step_seconds for s in self.steps]))

    @property
    def tokens_per_second(self) -> float:
        """Over its steps; with `delay`, `delay_of`'s over the delay's ratio (as its step)."""
        if self.delay is not None and self.delay_of is not None and self.steps:
            return self.delay_of.tokens_per_second / self.delay.ratio
        seconds = sum(s.step_seconds for s in self.steps)
        return sum(s.tokens for s in self.steps) / seconds if seconds else 0.0

    def breakdown(self) -> dict[str, float]:
        """Mean seconds of a step by part (`StepResult.breakdown`)."""
        layers = build_shape(self.config.model).n_layers
        parts = [s.breakdown(layers) for s in self.steps]
        return {k: float(np.mean([p[k] for p in parts])) for k in parts[0]} if parts else {}


@dataclass
class AutoPlan:
    """The ranking of every candidate; `best` is the fastest that fits."""

    candidates: list[Candidate]

    @property
    def ranked(self) -> list[Candidate]:
        """Those that fit and train the config's documents whole, fastest first; then those
        that fit but cut documents shorter (`Candidate.cut_at`); then those that do not fit;
        then those that cannot run."""
        runnable = [c for c in self.candidates if c.steps]

        def key(c: Candidate) -> tuple[float, int]:
            return (round(c.step_seconds, 12), c.switches_on)

        fitting = sorted((c for c in runnable if c.fits and c.cut_at is None), key=key)
        cutting = sorted((c for c in runnable if c.fits and c.cut_at is not None), key=key)
        others = sorted((c for c in runnable if not c.fits), key=key)
        return fitting + cutting + others + [c for c in self.candidates if not c.steps]

    @property
    def best(self) -> Candidate | None:
        first = self.ranked[0] if self.candidates else None
        good = first is not None and first.steps and first.fits and first.cut_at is None
        return first if good else None

    def why(self) -> str:
        """Where the winner gains most over the runner-up (the first fitting candidate that
        is not equally fast), by part of the step; and what its token room or outlier delay
        buys over the same composition without it."""
        fitting = [c for c in self.ranked if c.steps and c.fits and c.cut_at is None]
        best = fitting[0] if fitting else None
        if best is None:
            return "no composition runs and fits"
        slower = [c for c in fitting[1:] if c.step_seconds > best.step_seconds * TIE]
        if not slower:
            out = "the only composition that runs and fits, or all are equally fast"
        else:
            second = slower[0]
            gain = second.step_seconds / best.step_seconds
            out = f"{gain:.2f}x faster than the runner-up {second.name}"
            if best.delay is None and second.delay is None:  # parts of the same batches
                mine, theirs = best.breakdown(), second.breakdown()
                part = max(mine, key=lambda k: theirs[k] - mine[k])
                out += (f": most of it in {part} ({mine[part] * 1e3:.1f} ms against "
                        f"{theirs[part] * 1e3:.1f} ms a step)")  # fmt: skip
        base = best.room_of
        if base is not None and base.steps:
            out += (
                f"; with L = {best.config.train.tokens_per_rank} rather than "
                f"{base.config.train.tokens_per_rank} for the same batches it steps "
                f"{best.step_seconds / base.step_seconds:.2f}x {base.name}'s "
                f"{base.step_seconds:.3f} s"
            )
        delay = best.delay
        if delay is not None:
            out += (
                f"; with data.outlier_tokens = {delay.threshold} it trains "
                f"{delay.delayed_tokens_per_second:,.0f} tokens/s against "
                f"{delay.plain_tokens_per_second:,.0f} without, over {delay.batches} "
                f"batches of the data ({1 / delay.ratio:.3f}x)"
            )
        return out

    def record(self) -> list[dict]:
        return [
            {
                "composition": c.name,
                "step_seconds": c.step_seconds if c.steps else None,
                "tokens_per_second": c.tokens_per_second if c.steps else None,
                "step_over_bound": c.over_bound,
                "outlier_delay_ratio": c.delay.ratio if c.delay is not None else None,
                "memory_gb": c.memory_gb if c.steps else None,
                "fits": c.fits,
                "cuts_documents_at": c.cut_at,
                "error": c.error,
            }
            for c in self.ranked
        ]
