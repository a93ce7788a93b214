"""One batch of `ray-zep bench scale` planned and played: the product's plan as the data
actor makes it, or a baseline's schedule of micro-batches, and its simulated step."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ray_zep.config import Config, Packing
from ray_zep.parallel.axes import SEQUENCE_AXES
from ray_zep.sim.bytescale import bytescale_plans, simulate_schedule
from ray_zep.sim.megatron_cp import simulate_hybrid_cp
from ray_zep.sim.megatron_dynamic_cp import dynamic_cp_plans
from ray_zep.sim.step import RunModel, plan_batch, simulate_plan
from ray_zep.step_plan import plan_step

_SCHEDULERS = {"bytescale": bytescale_plans, "dynamic_cp": dynamic_cp_plans}
"""The variants that run a schedule of micro-batches (`Variant` flags), and its planner."""


def scheduler_of(variant):
    """The planner of the variant's micro-batch schedule, None for one plan a step."""
    return next((plans for flag, plans in _SCHEDULERS.items() if getattr(variant, flag)), None)


def plan_batch_timed(scheduler, lengths: np.ndarray, run: RunModel, repeats: int = 1):
    """(the step's plans, the baseline's micro-batches or None, its remap, the planner's
    wall seconds, the median of `repeats` calls): one plan as the data actor makes it, or
    the rounds of a baseline's `scheduler` (`_SCHEDULERS`)."""
    planned = [_planned_once(scheduler, lengths, run) for _ in range(repeats)]
    return (*planned[0][:3], float(np.median([seconds for *_, seconds in planned])))


def _planned_once(scheduler, lengths: np.ndarray, run: RunModel):
    started = time.perf_counter()
    micro, remap = None, None
    config, topology = run.config, run.hardware.topology
    if scheduler is not None:
        micro, plans = scheduler(lengths, run)
    elif SEQUENCE_AXES[config.parallel.sequence].whole_sequences:
        plan, remap = plan_batch(lengths, run)
        plans = [plan]
    else:  # what the data actor runs a step: the placement, its routing and its bytes
        step = plan_step(lengths, config, topology, run.shape)
        plans, remap = [step.attention], step.remap
    return plans, micro, remap, time.perf_counter() - started


def simulated_step(lengths: np.ndarray, run: RunModel, plans, micro, remap, waves: bool):
    """The simulated step of a batch placed as `plan_batch_timed` (`plans`, `micro`, `remap`) or,
    with `waves`, as megatron_hybrid_cp's wave `plans`."""
    if waves:
        return simulate_hybrid_cp(lengths, run, plans)
    if micro is not None:
        return simulate_schedule(lengths, micro, plans, run)
    return simulate_plan(plans[0], run, run.config.parallel.routing, remap)


def filled_config(config: Config, parts: list[np.ndarray], devices: int) -> Config:
    """`config` saying how full the batches it plays are: budget-packed at their mean
    tokens a rank over L (`data.batch_fill`), as `plan --auto` says it where it raises L
    for the same batches (`ray_zep.sim.token_room`). A run resolves what it reads of the
    tokens a rank holds from there: when FSDP2 gathers the next block
    (`ray_zep.prefetch_plan`). Placements of whole sequences, packed by rank, keep the
    config's."""
    if SEQUENCE_AXES[config.parallel.sequence].whole_sequences or not parts:
        return config
    mean = float(np.mean([int(np.sum(part)) for part in parts])) / devices
    fill = min(1.0, mean / config.train.tokens_per_rank)
    data = dataclasses.replace(config.data, packing=Packing.BUDGET, batch_fill=fill)
    return dataclasses.replace(config, data=data)
