"""`ray-zep bench step`: one rank's training step, timed, with its memory against the model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ray_zep.cli import main

pytestmark = pytest.mark.unit


def test_bench_step_times_both_batch_shapes_and_checks_the_memory_model(tmp_path: Path) -> None:
    code = main(
        ["bench", "step", "model.n_layers=1", "--tokens", "128", "--steps", "3",
         "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    record = json.loads((tmp_path / "step.json").read_text())
    rows = {r["batch"]: r for r in record["rows"]}
    assert set(rows) == {"packed", "long"}
    assert rows["long"]["sequences"] == 1.0, "a long batch is one sequence"
    assert rows["packed"]["sequences"] > 1.0, "packed batches hold several documents"
    for row in rows.values():
        assert row["tokens"] == 128 and row["tokens_per_s"] > 0 and math.isfinite(row["loss"])
        assert row["measured_gib"] > 0, "the steady steps' peak is measured"
        assert abs(row["model_error"]) < 0.10, row
    assert math.isnan(rows["long"]["mfu"]), "no peak FLOP/s is known for a CPU"


def test_bench_step_names_a_bad_flag(capsys) -> None:
    assert main(["bench", "step", "--batches", "short"]) != 0
    assert "--batches: 'short' is not one of packed, long" in capsys.readouterr().err
    assert main(["bench", "step", "--steps", "2"]) != 0
    assert "--steps=2" in capsys.readouterr().err
