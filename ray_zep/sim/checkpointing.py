"""Activation checkpointing chosen to fit the GPU's memory: none if that fits, else
`selective`, `linears` or `full` on the fewest first blocks that fit
(`train.checkpoint_blocks`, as Megatron-LM's `--recompute-num-layers` with
`--recompute-method block`), and `linears` or `full` on the fewest first blocks with
`selective` on the rest (`train.checkpoint_rest`), the one that recomputes less first.
`ray-zep bench scale` simulates every option and keeps the fastest; `ray-zep plan
--auto` takes the first for a composition that does not fit without it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import numpy as np

from ray_zep.config import Config
from ray_zep.model_shapes import ModelShape
from ray_zep.options import BENEATH_SELECTIVE, ActivationCheckpointing
from ray_zep.partition.plan_memory import plan_memory
from ray_zep.partition.stats import PlanStats
from ray_zep.partition.work import WorkModel
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.layer_work import recomputed_seconds
from ray_zep.sim.step import RunModel

CHECKPOINTING = (
    ActivationCheckpointing.NONE,
    ActivationCheckpointing.SELECTIVE,
    ActivationCheckpointing.LINEARS,
    ActivationCheckpointing.FULL,
)
"""The modes, keeping the most first (what a block keeps shrinks down the list;
`ray_zep.sim.step` counts what backward recomputes in the step)."""


def with_checkpointing(
    config: Config,
    mode: ActivationCheckpointing,
    blocks: int = 0,
    rest: ActivationCheckpointing = ActivationCheckpointing.NONE,
) -> Config:
    """`config` with `train.activation_checkpointing=mode` on its first `blocks` blocks
    (`train.checkpoint_blocks`; 0: every block) and `rest` on the others
    (`train.checkpoint_rest`)."""
    train = dataclasses.replace(config.train, activation_checkpointing=mode,
                                checkpoint_blocks=blocks, checkpoint_rest=rest)  # fmt: skip
    return dataclasses.replace(config, train=train)


def checkpointing_as(config: Config, source: Config) -> Config:
    """`config` under `source`'s activation checkpointing."""
    train = source.train
    return with_checkpointing(config, train.activation_checkpointing, train.checkpoint_blocks,
                              train.checkpoint_rest)  # fmt: skip


def fitting_options(
    config: Config, hardware: Hardware, run: RunModel, peak_of: Callable[[Config], float]
) -> list[tuple[Config, float]]:
    """The lightest activation checkpointing options whose modelled peak, `peak_of(config
    under it)`, fits the GPU, each with that peak: none, if it fits; else `selective`,
    `linears` and `full`, each on the fewest first blocks that fit
    (`train.checkpoint_blocks`), and `linears` and `full` on the fewest first blocks that
    fit with `selective` on the rest, the one that recomputes less by
    `recompute_per_block` first; where none fits on every block, `full` on every block
    alone."""
    unchecked = with_checkpointing(config, ActivationCheckpointing.NONE)
    peak = peak_of(unchecked)
    if peak <= hardware.usable_memory_bytes:
        return [(unchecked, peak)]
    layers, fitting = run.shape.n_layers, []
    for mode in CHECKPOINTING[1:]:
        blocks, peak = fewest_blocks(config, mode, layers, hardware, peak_of)
        if blocks is not None:
            cost = blocks * recompute_per_block(run, mode)
            fitting.append((cost, with_checkpointing(config, mode, blocks % layers), peak))
    selective = ActivationCheckpointing.SELECTIVE
    for mode in BENEATH_SELECTIVE:
        mixed = _then_selective(config, mode, layers, hardware, peak_of)
        if mixed is not None:
            blocks, peak = mixed
            cost = blocks * recompute_per_block(run, mode) + (
                layers - blocks
            ) * recompute_per_block(run, selective)
            fitting.append((cost, with_checkpointing(config, mode, blocks, selective), peak))
    if not fitting:
        heaviest = with_checkpointing(config, CHECKPOINTING[-1])
        return [(heaviest, peak_of(heaviest))]
    return [(chosen, peak) for _, chosen, peak in sorted(fitting, key=lambda f: f[0])]


def _then_selective(
    config: Config,
    mode: ActivationCheckpointing,
    layers: int,
    hardware: Hardware,
    peak_of: Callable[[Config], float],
) -> tuple[int, float] | None:
    """(the fewest first blocks, 1 to n - 1, that `mode` takes with `selective` on the
    rest where that fits; its peak), None where it needs every block or none."""
    if layers < 2:
        return None

    def under(checked: Config) -> float:  # `checked`: `mode` on its first blocks
        train = checked.train
        return peak_of(with_checkpointing(checked, train.activation_checkpointing,
                                          train.checkpoint_blocks,
                                          ActivationCheckpointing.SELECTIVE))  # fmt: skip

    blocks, peak = fewest_blocks(config, mode, layers, hardware, under)
    if blocks is None or not 1 <= blocks < layers:
        return None
    return blocks, peak


def plans_peak(
    plans: Iterable[PlanStats], hardware: Hardware, shape: ModelShape
) -> Callable[[Config], float]:
    """`fitting_options`' `peak_of` for placed plans: the fullest rank's modelled bytes over
    `plans` under a config."""
    plans = list(plans)

    def peak_of(config: Config) -> float:
        held = (plan_memory(config, hardware.topology, one, shape) for one in plans)
        return max(h.ranks[h.fullest].total for h in held)

    return peak_of


def fewest_blocks(
    config: Config,
    mode: ActivationCheckpointing,
    layers: int,
    hardware: Hardware,
    peak_of: Callable[[Config], float],
) -> tuple[int | None, float]:
    """(the fewest first blocks under `mode` whose peak fits, None where even every block
    does not; that peak). The peak falls as blocks are added, so a bisection finds it."""
    low, high = 0, layers  # low does not fit (none did not); high is checked first
    peak = peak_of(with_checkpointing(config, mode, layers))
    if peak > hardware.usable_memory_bytes:
        return None, peak
    while high - low > 1:
        middle = (low + high) // 2
        trial = peak_of(with_checkpointing(config, mode, middle))
        if trial <= hardware.usable_memory_bytes:
            high, peak = middle, trial
        else:
            low = middle
    return high, peak


def recompute_per_block(run: RunModel, mode: ActivationCheckpointing) -> float:
    """What one checkpointed block's backward recomputes for a rank holding L tokens as
    one sequence, modelled seconds: its whole forward (`full`: a third of the block's
    forward and backward work), its projections (`linears`) or its feed-forward part
    (`selective`). It orders the options only; a simulated step counts what the chosen
    one recomputes."""
    shape, tokens = run.shape, run.config.train.tokens_per_rank
    if mode is not ActivationCheckpointing.FULL:
        return recomputed_seconds(shape, mode, tokens, run.hardware.rates)
    model = WorkModel.create(shape, run.hardware.topology, run.hardware.rates)
    return float(model.whole_seconds(np.asarray([tokens]))[0]) / shape.n_layers / 3


def checkpointing_label(config: Config, shape: ModelShape) -> str:
    """The config's checkpointing in a table cell: the mode, and "k/n" where it applies
    to the first k of n blocks."""
    train = config.train
    blocks = train.checkpointed(shape.n_layers)
    if blocks in (0, shape.n_layers):
        return train.activation_checkpointing.value
    label = f"{train.activation_checkpointing.value} {blocks}/{shape.n_layers}"
    if train.rest_checkpointed(shape.n_layers):
        label += f"+{train.checkpoint_rest.value}"
    return label
