"""The parallelism axes: every cell of the matrix trains or is refused when the config loads.

A cell is a sequence placement x a weights mode x a model (dense, or MoE with
expert parallelism 2 and the 1a1m pipeline). Refused cells fail in
`load_config` / `prepare_run` with a one-line ConfigError; every other cell
trains one step on the virtual 2 x 2 cluster (one process for `single`), with a
short collective timeout so that a hang would surface as an error.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest

from ray_zep.config import load_config
from ray_zep.errors import ConfigError
from ray_zep.parallel.axes import AxesChoice, Placement, WeightsMode, matrix_rows, refusal
from ray_zep.train.setup import prepare_run
from tests.helpers.procs import run_ranks
from tests.helpers.training import SMALL_RUN, train_rank

MODELS = {
    "dense": [],
    "moe": [
        "model.preset=tiny_moe",
        "model.moe.capacity_factor=0",
        "parallel.ep=2",
        "parallel.moe_pipeline=1a1m",
        "parallel.moe_overlap_degree=2",
    ],
}
BASE = [
    *SMALL_RUN,
    "topology.nodes=2",
    "topology.gpus_per_node=2",
    "train.steps=1",
    "train.tokens_per_rank=128",
    "train.sample_ledger=false",
    "train.save_last=false",  # no cell's checkpoint is read
    "comm.timeout_s=20",
]


def _cell(sequence: Placement, weights: WeightsMode, model: str) -> list[str]:
    packing = "rank" if sequence in (Placement.WHOLE, Placement.SINGLE) else "budget"
    return [
        *BASE,
        *MODELS[model],
        f"parallel.sequence={sequence.value}",
        f"parallel.weights={weights.value}",
        f"data.packing={packing}",
    ]


def _cells() -> list[tuple[str, list[str]]]:
    return [
        (f"{s.value}+{w.value}+{m}", _cell(s, w, m))
        for s in Placement
        for w in WeightsMode
        for m in MODELS
    ]


def _try_train(rank: int, world: int, cells: list[tuple[str, list[str]]]) -> dict[str, str]:
    """Train every cell one step; the outcome of each ("trained" or the traceback)."""
    outcomes = {}
    for name, overrides in cells:
        try:
            result = train_rank(rank, world, overrides)
            outcomes[name] = "trained" if result["losses"] else "no step"
        except Exception:
            outcomes[name] = traceback.format_exc()
    return outcomes


@pytest.mark.dist
def test_every_cell_of_the_matrix_trains_or_is_refused_when_the_config_loads(
    tmp_path: Path,
) -> None:
    refused, trains = {}, {1: [], 4: []}
    for name, overrides in _cells():
        overrides = [*overrides, f"train.out_dir={tmp_path / name}"]
        try:
            config = load_config(None, overrides)
            prepare_run(config, write_config=False)
        except ConfigError as exc:
            refused[name] = str(exc)
            continue
        trains[config.parallel.sequence_axis.processes(4)].append((name, overrides))
    for name, message in refused.items():
        assert "\n" not in message and message.startswith("config key "), (name, message)
    outcomes = {**run_ranks(_try_train, 1, trains[1])[0], **run_ranks(_try_train, 4, trains[4])[0]}
    failed = {name: text for name, text in outcomes.items() if text != "trained"}
    assert not failed, "cells that neither trained nor were refused:\n" + "\n".join(
        f"{name}: {text[-800:]}" for name, text in failed.items()
    )
    assert len(outcomes) + len(refused) == len(Placement) * len(WeightsMode) * len(MODELS)
    # the matrix the README prints is the one the config enforces (dense models)
    for sequence, weights, verdict in matrix_rows():
        name = f"{sequence}+{weights}+dense"
        assert (name in outcomes) == (verdict == "trains"), name


@pytest.mark.unit
def test_refusals_name_the_key_and_the_way_out() -> None:
    why = refusal(AxesChoice(Placement.ZEPPELIN, WeightsMode.TAWPIPE))
    assert why is not None and why[0] == "parallel.weights"
    assert "parallel.sequence=whole or parallel.weights=fsdp" in why[1]
    assert refusal(AxesChoice(Placement.ZEPPELIN, WeightsMode.HSDP, ep=2, moe_model=True)) is None
