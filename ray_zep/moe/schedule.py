"""The order in which a pipelined MoE block issues its work (FoldMoE §3, §4.1).

A block with overlap degree d runs d attention slices and d MoE micro-batches.
Each micro-batch goes through four steps; the two all-to-alls run in the
background between the step that posts them and the step that waits:

    ATTEND i    attention of slice i (q/k/v, attention over earlier keys, output
                projection, residual, norm), its tokens into the token buffer
    DISPATCH j  gate micro-batch j from the buffer, post its dispatch all-to-all
    EXPERTS j   wait for the dispatch, run the local experts, post the combine
    COMBINE j   wait for the combine, weight and add the expert outputs

A schedule is the order of these steps on the compute stream; the executor
(`ray_zep.moe.pipeline`) and the simulator (`ray_zep.sim.moe_block`) play the
same list. Backward runs the steps in reverse (autograd runs the latest-created
work first), with each transfer's reverse posted by the step that waited for
it and waited for by the step that posted it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ray_zep.config import MoEPipeline


class Kind(Enum):
    ATTEND = "attend"
    DISPATCH = "dispatch"
    EXPERTS = "experts"
    COMBINE = "combine"


@dataclass(frozen=True)
class Step:
    kind: Kind
    index: int

    def __str__(self) -> str:
        return f"{self.kind.value[0].upper()}{self.index}"


def _moe(j: int) -> list[Step]:
    """The experts of micro-batch j, then the combine of micro-batch j-1.

    Waiting for combine j-1 here rather than at the end costs little in forward
    (the compute stream waits while the link stays busy) and puts the
    backward's reverse transfers in the mirror order, D and C interleaved,
    instead of every combine gradient first.
    """
    return [Step(Kind.EXPERTS, j)] + ([Step(Kind.COMBINE, j - 1)] if j else [])


def build_program(schedule: MoEPipeline, degree: int) -> list[Step]:
    """The compute-stream order of `schedule` with `degree` micro-batches.

    - none: one slice, one micro-batch, every transfer waited for at once;
    - moe_only: attention whole, then micro-batches dispatched one ahead of
      the experts (each combine posted right after its experts);
    - aaam: all attention slices (each micro-batch dispatched as soon as the
      buffer holds it), then all experts;
    - 1a1m: after attention slice i, the experts of micro-batch i-1.

    Combine j is waited for after the experts of micro-batch j+1 (see `_moe`).
    """
    d = 1 if schedule is MoEPipeline.NONE else degree
    attend = [Step(Kind.ATTEND, i) for i in range(d)]
    dispatch = [Step(Kind.DISPATCH, j) for j in range(d)]
    last = [Step(Kind.COMBINE, d - 1)]
    if schedule in (MoEPipeline.NONE,):
        return [attend[0], dispatch[0], *_moe(0), *last]
    if schedule is MoEPipeline.MOE_ONLY:
        steps = [Step(Kind.ATTEND, 0), dispatch[0]]
        for j in range(d):
            steps += ([dispatch[j + 1]] if j + 1 < d else []) + _moe(j)
        return steps + last
    if schedule is MoEPipeline.AAAM:
        steps = [s for i in range(d) for s in (attend[i], dispatch[i])]
        return steps + [s for j in range(d) for s in _moe(j)] + last
    steps = [attend[0], dispatch[0]]
    for i in range(1, d):
        steps += [attend[i], dispatch[i], *_moe(i - 1)]
    return steps + _moe(d - 1) + last


def attention_slices(schedule: MoEPipeline, degree: int) -> int:
    """How many attention slices a program has (moe_only and none: one)."""
    return degree if schedule in (MoEPipeline.AAAM, MoEPipeline.ONE_A_ONE_M) else 1
