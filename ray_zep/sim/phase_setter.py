"""Which rank ends a simulated layer's forward and its backward, and what it holds:
where to look first when a step sits above its bound (`ray-zep simulate`).

A layer's phase ends when its last rank's last task does (a gather for a later layer
aside). That rank's time splits as `ray_zep.sim.idle` charges it: its compute, then its
idle time by cause, transfers or waits, adding up to the phase's makespan. What it
holds is read from the plan played: each sequence it has a share of, with the group it
shares it with. On 4,096-GPU 13b chat, for one, the forward ends on a 157k-token
document's group of 13 one-node positions, whose ranks compute half of the phase and
wait on their NICs for the rest (BENCHMARKS.md, thirty-eighth series).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ray_zep.partition.plan import AttentionPlan
from ray_zep.sim.events import Lane, Timeline
from ray_zep.sim.idle import TRANSFERS, WAITS, idle_causes
from ray_zep.sim.step import StepResult


@dataclass(frozen=True)
class Held:
    """A sequence the rank has a share of: its tokens, the ranks of its group, Ulysses
    members per ring position (1: a plain ring or a whole sequence), ring positions and
    how K/V move between them."""

    tokens: int
    ranks: int
    ulysses: int
    positions: int
    exchange: str


@dataclass(frozen=True)
class PhaseSetter:
    """The rank whose tasks end a phase last, its seconds a layer by what it was doing,
    and the sequences it holds (the longest first)."""

    phase: str
    rank: int
    layer_seconds: float
    compute_seconds: float
    transfers_seconds: float
    waits_seconds: float
    holds: tuple[Held, ...]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def sentence(self) -> str:
        """One line: the phase, the rank, where its time went and what it holds."""
        ms = 1e3
        split = [f"computing {self.compute_seconds * ms:.1f}"]
        if self.transfers_seconds * ms >= 0.05:
            split.append(f"on transfers {self.transfers_seconds * ms:.1f}")
        if self.waits_seconds * ms >= 0.05:
            split.append(f"waiting on others {self.waits_seconds * ms:.1f}")
        return (
            f"{self.phase} ends on rank {self.rank} ({self.layer_seconds * ms:.1f} ms a layer: "
            f"{', '.join(split)} ms), which holds {_holdings(self.holds)}"
        )


def phase_setters(step: StepResult) -> list[PhaseSetter]:
    """The rank ending the forward and the one ending the backward of `step`'s layer
    (its first micro-batch's, where it has several); none for a step without layer
    timelines or a plan (weight-passing modes)."""
    first = step.micro_steps[0] if step.micro_steps else step
    if first.forward is None or first.backward is None or first.plan is None:
        return []
    return [
        _setter(phase, timeline, first.plan)
        for phase, timeline in (("forward", first.forward), ("backward", first.backward))
    ]


def _setter(phase: str, timeline: Timeline, plan: AttentionPlan) -> PhaseSetter:
    tasks = timeline.graph.tasks
    ends = timeline.end.copy()
    ahead = timeline.graph.ahead
    ends[ahead.start : ahead.stop] = -np.inf  # a gather for a later layer: not this one's
    rank = int(tasks[int(np.argmax(ends))].rank)
    idle = idle_causes(timeline, rank)
    holds = [
        Held(p.length, len(p.ranks), p.ulysses, p.ring_size, p.exchange.name.lower())
        for p in plan.placements
        if rank in p.ranks
    ]
    holds.sort(key=lambda h: -h.tokens)
    return PhaseSetter(
        phase,
        rank,
        timeline.makespan,
        timeline.busy(rank, Lane.COMPUTE),
        idle[TRANSFERS],
        idle[WAITS],
        tuple(holds),
    )


SHOWN = 3
"""Split sequences named in a sentence (the longest); the rest are counted."""


def _holdings(holds: tuple[Held, ...]) -> str:
    """The longest sequences split over groups, each with its group; then how many more
    split ones and how many whole ones."""
    split = [h for h in holds if h.ranks > 1]
    whole = len(holds) - len(split)
    parts = []
    for h in split[:SHOWN]:
        if h.ulysses > 1:
            group = f"{h.positions} positions of {h.ulysses} GPUs"
        else:
            group = f"a ring of {h.ranks}"
        parts.append(f"a share of a {h.tokens:,}-token sequence ({group}, {h.exchange})")
    if len(split) > SHOWN:
        parts.append(f"shares of {len(split) - SHOWN} more split sequences")
    if whole:
        parts.append(f"{whole} whole sequence{'s' if whole > 1 else ''}")
    return ", ".join(parts) if parts else "nothing"
