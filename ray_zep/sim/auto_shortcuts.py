"""The shortcuts of `ray-zep plan --auto` (`ray_zep.sim.auto`) that leave every figure it
prints as playing every composition gives it: a remap composition that remaps no batch takes
its twin's steps (`played_by_twin`), and a group whose floor is above the second fastest
step played (`second_fastest`) is not played (`unbeaten`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ray_zep.config import Packing
from ray_zep.parallel.axes import SEQUENCE_AXES
from ray_zep.sim.auto_ranking import TIE, Candidate
from ray_zep.sim.kv_floor import busiest_compute, kv_floor_seconds


def unbeaten(candidates: list[Candidate], runs, placed, stats, above: float) -> list[int]:
    """The indices of `candidates` to play: all of them where one's floor is not above
    `above` (the group shares one layer program: one candidate's play costs about all of
    theirs), else none, each saying why. The floor, averaged over the batches, is the
    higher of each batch's bound and what its plan alone allows (`kv_floor_seconds`: each
    phase of a layer the longest of the ring bytes its busiest NIC sends, a gathered
    ring's collectives and its busiest rank's compute, `busiest_compute` of the batch's
    `stats`)."""
    routed = runs[0].config.parallel.routing
    # the group's runs differ only in their switches, which leave the compute as it is
    computes = [busiest_compute(one, runs[0], remap is not None)
                for (_, remap), one in zip(placed, stats, strict=True)]  # fmt: skip
    floors = []
    for candidate, run in zip(candidates, runs, strict=True):
        each = zip(candidate.bounds, placed, computes, strict=True)
        floors.append(float(np.mean([max(bound, kv_floor_seconds(plan, run, routed, compute))
                                     for bound, (plan, _), compute in each])))  # fmt: skip
    if min(floors) <= above:
        return list(range(len(candidates)))
    for candidate, floor in zip(candidates, floors, strict=True):
        candidate.error = (f"not played: a step takes at least {floor:.3f} s here (its bound, "
                           "its busiest rank's compute and the ring bytes its busiest NIC "
                           f"sends), over the {above:.3f} s of two faster "
                           "compositions")  # fmt: skip
    return []


def played_by_twin(candidates: list[Candidate], placed, twin: list[Candidate] | None) -> bool:
    """Whether `twin` (`ray_zep.sim.auto.evaluate_group`) has played these candidates'
    steps: no batch remapped, and each twin the same composition but for the remap; where
    so, its steps and bounds are copied over."""
    if twin is None or len(twin) != len(candidates) or any(r is not None for _, r in placed):
        return False
    for candidate, other in zip(candidates, twin, strict=True):
        config = candidate.config
        off = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                       remap=False))  # fmt: skip
        if off != other.config or not other.steps:
            return False
    for candidate, other in zip(candidates, twin, strict=True):
        candidate.steps, candidate.bounds = list(other.steps), list(other.bounds)
    return True


def second_fastest(candidates: list[Candidate], packing: Packing) -> float | None:
    """The step of the second fastest of the played compositions that split sequences, fit,
    and pack as the config's (`packing`), not as fast as the fastest; None where fewer
    than two such. A composition slower than it is neither the winner nor the runner-up,
    nor the fastest budget-packed one that token room, micro-batches and outlier delay are
    played from, so `ray_zep.sim.auto.evaluate_group` need not play it."""
    steps = sorted(c.step_seconds for c in candidates
                   if c.steps and c.fits and c.config.data.packing is packing
                   and not SEQUENCE_AXES[c.config.parallel.sequence].whole_sequences)  # fmt: skip
    return next((s for s in steps if s > steps[0] * TIE), None) if steps else None
