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
    assert rows["long"]["held"] == 128, "a long batch's pieces fill L"
    assert 0 < rows["packed"]["held"] <= 128, "whole documents fill a packed step to L at most"
    for row in rows.values():
        assert row["tokens"] == 128 and math.isfinite(row["loss"])
        assert row["tokens_per_s"] == pytest.approx(row["held"] / row["seconds"]), (
            "tokens/s counts the tokens the steps held"
        )
        assert row["measured_gib"] > 0, "the steady steps' peak is measured"
        assert abs(row["model_error"]) < 0.10, row
    assert math.isnan(rows["long"]["mfu"]), "no peak FLOP/s is known for a CPU"


def test_bench_step_reports_the_model_and_the_chunked_loss(tmp_path: Path) -> None:
    code = main(
        ["bench", "step", "--layers", "1", "--loss-chunk", "48", "--tokens", "64",
         "--batches", "long", "--steps", "3", "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    record = json.loads((tmp_path / "step.json").read_text())
    assert record["spec"]["loss_chunk_tokens"] == 48 and record["spec"]["compile"] is False
    assert record["spec"]["model"]["n_layers"] == 1
    (row,) = record["rows"]
    assert (row["model"], row["loss_chunk"], row["compiled"]) == ("tiny x1", 48, False)
    assert math.isfinite(row["loss"]) and row["tokens_per_s"] > 0


def test_bench_step_plays_each_checkpointing_mode_beside_none(tmp_path: Path) -> None:
    code = main(
        ["bench", "step", "--layers", "2", "--tokens", "64", "--batches", "long", "--steps", "3",
         "--checkpointing", "none,selective,full", "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    record = json.loads((tmp_path / "step.json").read_text())
    assert record["spec"]["checkpointing"] == ["none", "selective", "full"]
    rows = {r["checkpointing"]: r for r in record["rows"]}
    assert set(rows) == {"none", "selective", "full"}
    assert rows["none"]["over_none_s"] == 0.0
    for mode in ("selective", "full"):
        row = rows[mode]
        assert row["over_none_s"] == pytest.approx(row["seconds"] - rows["none"]["seconds"])
        assert math.isnan(row["modelled_s"]), "no preset rates for a CPU: no modelled step"


def test_the_modelled_step_recomputes_what_each_mode_says() -> None:
    from ray_zep.bench.step import _case_config
    from ray_zep.bench.step_model import modelled_step
    from ray_zep.config import load_config
    from ray_zep.options import ActivationCheckpointing

    base = load_config(None, ["model.preset=7b", "model.n_layers=2"])

    def step(mode: str, device: str = "NVIDIA H200"):
        config = _case_config(base, "packed", 8192, 3, ActivationCheckpointing(mode))
        return modelled_step(config, device, [[4096, 1024], [2048, 2048, 1024]])

    none, selective, linears, full = (step(m) for m in ("none", "selective", "linears", "full"))
    assert none.recompute_seconds == 0.0 and none.step_seconds > 0
    assert 0 < selective.recompute_seconds < linears.recompute_seconds < full.recompute_seconds
    assert selective.step_seconds == pytest.approx(none.step_seconds + selective.recompute_seconds)
    assert math.isnan(step("none", "CPU").step_seconds)


def test_bench_step_names_a_bad_flag(capsys) -> None:
    assert main(["bench", "step", "--batches", "short"]) != 0
    assert "--batches: 'short' is not one of packed, long" in capsys.readouterr().err
    assert main(["bench", "step", "--steps", "2"]) != 0
    assert "--steps=2" in capsys.readouterr().err
    assert main(["bench", "step", "--layers", "0"]) != 0
    assert "--layers=0 must be >= 1" in capsys.readouterr().err
    assert main(["bench", "step", "--loss-chunk", "-1"]) != 0
    assert "--loss-chunk=-1 must be >= 0" in capsys.readouterr().err
    assert main(["bench", "step", "--checkpointing", "some"]) != 0
    assert "--checkpointing: 'some' is not one of" in capsys.readouterr().err
