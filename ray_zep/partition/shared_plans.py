"""One plan of a batch for every composition that would place it alike.

`ray-zep plan --auto` places the same batches under dozens of compositions. A planner
that declares the `ParallelConfig` fields it reads (`PlacementSpec.reads`) makes the same
plan under every composition that agrees on those fields, L, the cluster and the model,
whatever its weights mode, routing or remapping layer. Inside `sharing_plans()`,
`make_plan` keeps the first such plan of each batch and hands it to the next ones: at
4,096 GPUs a plan of one ring over every rank (`te_cp`, `llama_cp`, `usp`) holds 8,193
offsets a sequence and took seconds to make, once for each of the groups the search
plays it in.

Plans are kept for one setting at a time (the last placement, L, cluster, model and read
fields asked for), so that the search holds one placement's batches at once, not all of
them. A planner that declares nothing (None) is run every time. Plans are never changed
after they are made (their caches of derived figures are the same for every holder).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np

from ray_zep.config import ParallelConfig
from ray_zep.model_shapes import ModelShape
from ray_zep.parallel.axes import Placement
from ray_zep.partition.plan import AttentionPlan
from ray_zep.topology import Topology


@dataclass
class _Kept:
    """The plans kept for one setting, by their batch's lengths."""

    setting: tuple | None = None
    plans: dict[bytes, AttentionPlan] = field(default_factory=dict)


_KEPT: ContextVar[_Kept | None] = ContextVar("shared_plans", default=None)


@contextlib.contextmanager
def sharing_plans() -> Iterator[None]:
    """Within the block, `shared_plan` hands one plan to every composition that places a
    batch alike (module docstring); the plans are let go at its end."""
    token = _KEPT.set(_Kept())
    try:
        yield
    finally:
        _KEPT.reset(token)


def shared_plan(
    placement: Placement,
    reads: tuple[str, ...] | None,
    lengths: np.ndarray,
    topology: Topology,
    tokens_per_rank: int,
    shape: ModelShape,
    parallel: ParallelConfig,
    make: Callable[[], AttentionPlan],
) -> AttentionPlan:
    """The plan `make` gives for `lengths` (int64), or the one it gave before under the
    same setting where plans are shared and the planner declares what it `reads`."""
    kept = _KEPT.get()
    if kept is None or reads is None:
        return make()
    setting = (placement, tokens_per_rank, topology, shape,
               tuple(getattr(parallel, name) for name in reads))  # fmt: skip
    if setting != kept.setting:
        kept.setting, kept.plans = setting, {}
    key = lengths.tobytes()
    plan = kept.plans.get(key)
    if plan is None:
        plan = kept.plans[key] = make()
    return plan
