"""A rank makes its weights after they are split and sharded (`build_model(deferred=True)`,
`apply_axes`): each parameter drawn whole on the host, one at a time, and its own part
kept on the device, so no process holds the whole model, and the weights are those of
the whole model drawn at once."""

from __future__ import annotations

import pytest

from tests.helpers.placing import made_weights
from tests.helpers.procs import run_ranks
from tests.helpers.training import NEEDS_EXPERT_MESH, SMALL_RUN

EXPERTS = ["model.preset=tiny_moe", "model.n_layers=2", "parallel.ep=2"]
"""Experts split over both ranks."""


@pytest.mark.dist
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["parallel.weights=fsdp"], id="fsdp"),
        pytest.param(["parallel.weights=replicated"], id="replicated"),
        pytest.param([*EXPERTS, "parallel.weights=replicated"], id="experts"),
        pytest.param(
            [*EXPERTS, "parallel.weights=fsdp"], marks=NEEDS_EXPERT_MESH, id="experts-fsdp"
        ),
    ],
)
def test_each_rank_makes_only_its_own_part_of_the_seeded_weights(overrides) -> None:
    """Sharded, split or replicated, every rank's weights (gathered whole) equal the whole
    model's drawn at once, bit for bit, and a rank makes them only after FSDP2 shards them
    (weight passing: the axes matrix trains it like one process)."""
    for events, equal, differs in run_ranks(made_weights, 2, [*SMALL_RUN, *overrides]):
        assert equal, f"{differs} differs from the whole model's"
        sharded = "parallel.weights=fsdp" in overrides
        assert events == (["shard", "make"] if sharded else ["make"])
