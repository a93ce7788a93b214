"""Pictures: a run's loss/throughput/load PNGs, `ray-zep report`, and the skip without
matplotlib (an optional dependency: `pip install 'ray-zep[plots]'`)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest

from ray_zep.cli import main
from ray_zep.report.figures import INSTALL_HINT, save_figure
from ray_zep.report.run_plots import (
    RUN_PICTURES,
    draw_run,
    imbalance,
    rank_matrix,
    steady_tokens_per_second,
)
from ray_zep.report.timeline import draw_throughput
from tests.helpers.pictures import assert_matplotlib_png, read_png

pytestmark = pytest.mark.unit


def _write_run(run_dir: Path, steps: int = 5, flops: bool = False) -> Path:
    """A metrics.jsonl as a 4-rank run writes it, plus a row that is not a step row."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"event": "restart", "step": 0}]
    for step in range(1, steps + 1):
        ranks = [1024 + 40 * step, 900, 1100, 1000 - 40 * step]
        row = {
            "step": step,
            "loss": 5.5 - 0.25 * step,
            "tokens": sum(ranks),
            "step_seconds": 2.0 if step == 1 else 1.0,
            "tokens_per_second": sum(ranks) / (2.0 if step == 1 else 1.0),
            "rank_tokens": ranks,
        }
        if flops:
            row["rank_flops"] = [2.0e10 * t / 1024 for t in ranks]
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


@pytest.mark.parametrize("flops", [False, True])
def test_draw_run_writes_three_matplotlib_pictures(tmp_path: Path, flops: bool) -> None:
    run_dir = _write_run(tmp_path / "run", flops=flops)
    written = draw_run(run_dir)
    assert [p.name for p in written] == list(RUN_PICTURES)
    for path in written:
        assert path.parent == run_dir
        assert_matplotlib_png(path)
    load = read_png(run_dir / "load.png")
    assert load.shape[1] > (1300 if flops else 600), "a second panel for rank_flops"


def test_a_rank_whose_flops_never_change_still_gets_its_load_picture(tmp_path: Path) -> None:
    run_dir = _write_run(tmp_path / "run", flops=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:  # equal values whose float mean rounds below them
        row["rank_flops"] = [1.0e9, 123.456e9, 2.0e9, 3.0e9]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert np.mean([123.456] * 5) < 123.456
    assert [p.name for p in draw_run(run_dir)] == list(RUN_PICTURES)


def test_steady_state_and_imbalance_numbers() -> None:
    rows = [
        {"step": 1, "step_seconds": 4.0, "tokens": 100},
        {"step": 2, "step_seconds": 1.0, "tokens": 300},
        {"step": 3, "step_seconds": 1.0, "tokens": 500},
    ]
    assert steady_tokens_per_second(rows) == 400.0  # the first step is warm-up
    matrix = rank_matrix([{"r": [1, 3]}, {"r": [2, 2, 2]}, {"other": 1}], "r")
    assert matrix is not None and matrix.shape == (2, 3) and np.isnan(matrix[0, 2])
    assert imbalance(matrix) == (1.25, 1.5)


def test_report_command_prints_every_picture(tmp_path: Path, capsys) -> None:
    run_dir = _write_run(tmp_path / "run", steps=3)
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"wrote {run_dir / name}" for name in RUN_PICTURES]


def test_report_without_metrics_is_one_line_exit_2(tmp_path: Path, capsys) -> None:
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ray-zep: error:") and len(err.strip().splitlines()) == 1
    assert "metrics.jsonl" in err and str(tmp_path) in err


def test_without_matplotlib_pictures_are_skipped_with_the_install_hint(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    with caplog.at_level(logging.WARNING, logger="ray_zep"):
        assert save_figure(tmp_path / "a.png", lambda figure, axes: None) is None
        assert draw_throughput("t", ["x"], [1.0], tmp_path / "b.png") is None
        assert draw_run(_write_run(tmp_path / "run")) == []
    assert not list(tmp_path.rglob("*.png"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all(INSTALL_HINT in line for line in lines), lines
    assert "a.png" in lines[0] and "load.png" in lines[2]
