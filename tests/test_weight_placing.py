"""A rank's weights reach its device after they are split: FSDP2 moves each unit as it
shards it (`apply_axes`), so the whole model is never on one device at once."""

from __future__ import annotations

import pytest

from tests.helpers.placing import placing_order
from tests.helpers.procs import run_ranks
from tests.helpers.training import NEEDS_EXPERT_MESH, SMALL_RUN

EXPERTS = ["model.preset=tiny_moe", "model.n_layers=2", "parallel.ep=2"]
"""Experts split over both ranks: FSDP2 leaves them to their own group (one replica)."""


@pytest.mark.dist
@pytest.mark.parametrize(
    ("overrides", "events"),
    [
        pytest.param(["parallel.weights=fsdp"], ["shard"], id="fsdp"),
        pytest.param(["parallel.weights=replicated"], ["model.to"], id="replicated"),
        pytest.param(
            [*EXPERTS, "parallel.weights=fsdp"], ["shard"], marks=NEEDS_EXPERT_MESH, id="experts"
        ),
    ],
)
def test_sharded_weights_reach_the_device_unit_by_unit(overrides, events) -> None:
    """Under FSDP2 the trainer never moves the whole model: sharding places each unit
    (and the experts FSDP2 leaves to their group follow); replicated weights move whole,
    once. Every parameter and buffer ends on the device either way."""
    for got, devices in run_ranks(placing_order, 2, [*SMALL_RUN, *overrides]):
        assert got == events
        assert devices == ["cpu"]
