"""Activation checkpointing chosen to fit the GPU (`ray_zep.sim.checkpointing`)."""

from __future__ import annotations

import dataclasses

import pytest

from ray_zep.config import load_config
from ray_zep.options import ActivationCheckpointing as Mode
from ray_zep.partition.plan_memory import rank_memory
from ray_zep.sim.checkpointing import checkpointing_label, fitting_options
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel
from ray_zep.topology import build_topology

pytestmark = pytest.mark.unit


def test_full_on_a_few_blocks_and_selective_on_the_rest_fits_with_less_recomputed() -> None:
    """A 7B rank of 28k tokens, all in rings, on cluster A's 80 GB: `selective` on every
    block does not fit, `full` needs most blocks; `full` on a few and `selective` on the
    rest fits and recomputes less; `linears` on a few more and `selective` on the rest
    recomputes the least (never the attention), so it comes first."""
    config = load_config(None, ["topology.preset=cluster_a", "topology.nodes=8",
                                "model.preset=7b", "train.tokens_per_rank=28672",
                                "parallel.weights=fsdp"])  # fmt: skip
    hardware = Hardware.preset(build_topology(config.topology))
    run = RunModel.create(config, hardware)
    capacity, layers = config.train.tokens_per_rank, run.shape.n_layers

    def peak_of(checked) -> float:
        return rank_memory(checked, hardware.topology, run.shape, capacity, capacity).total

    options = fitting_options(config, hardware, run, peak_of)
    modes = [(o.train.activation_checkpointing, o.train.checkpoint_rest) for o, _ in options]
    for mode in (
        (Mode.FULL, Mode.SELECTIVE),
        (Mode.FULL, Mode.NONE),
        (Mode.LINEARS, Mode.SELECTIVE),
    ):
        assert mode in modes, modes
    assert (Mode.SELECTIVE, Mode.NONE) not in modes, "selective alone does not fit"
    for option, peak in options:
        assert peak == peak_of(option) <= hardware.usable_memory_bytes
    mixed, _ = options[modes.index((Mode.FULL, Mode.SELECTIVE))]
    alone, _ = options[modes.index((Mode.FULL, Mode.NONE))]
    linears, _ = options[modes.index((Mode.LINEARS, Mode.SELECTIVE))]
    few = mixed.train.checkpointed(layers)
    assert 1 < few < alone.train.checkpointed(layers) < layers
    assert mixed.train.rest_checkpointed(layers) == layers - few
    assert modes.index((Mode.FULL, Mode.SELECTIVE)) < modes.index((Mode.FULL, Mode.NONE))
    assert options[0][0] is linears, "it recomputes the least"
    # it keeps more than full a block: it needs more blocks than full does
    more = linears.train.checkpointed(layers)
    assert few < more < layers
    assert checkpointing_label(mixed, run.shape) == f"full {few}/{layers}+selective"
    assert checkpointing_label(linears, run.shape) == f"linears {more}/{layers}+selective"
    # one block fewer under full does not fit: the fewest
    fewer = dataclasses.replace(mixed.train, checkpoint_blocks=few - 1)
    assert peak_of(dataclasses.replace(mixed, train=fewer)) > hardware.usable_memory_bytes
