"""`ray-zep bench soak`'s judgement of a long run, on made-up metrics rows: what grows
is named, what holds passes (the bench itself is measured in BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ray_zep.bench.soak import draw_soak, soak_report
from ray_zep.errors import ConfigError

pytestmark = pytest.mark.unit

MIB = 2**20


def _rows(steps: int, leak: float = 0.0, fds_leak: int = 0, slower: float = 0.0) -> list:
    """Two ranks, a driver and a data actor; rank 1 grows by `leak` (a share of its size)
    and opens `fds_leak` descriptors over the run; steps get `slower` slower."""
    rng = np.random.default_rng(0)
    rows = []
    for step in range(1, steps + 1):
        done = step / steps
        rows.append(
            {
                "step": step,
                "step_seconds": 1.0 * (1 + slower * done) + rng.normal(0, 0.05),
                "rss_bytes": {"driver": 900 * MIB, "data": 880 * MIB,
                              "ranks": [600 * MIB, int(600 * MIB * (1 + leak * done))]},
                "open_fds": {"driver": 40, "data": 52,
                             "ranks": [100, 100 + round(fds_leak * done)]},
            }
        )  # fmt: skip
    return rows


def test_a_flat_run_passes_and_a_growing_rank_is_named() -> None:
    flat = soak_report(_rows(400), warm_up=40)
    assert all(p.flat for p in flat.processes) and flat.step_flat
    assert [p.process for p in flat.processes] == ["driver", "data", "rank 0", "rank 1"]
    assert flat.window == 36

    leaking = soak_report(_rows(400, leak=0.10), warm_up=40)
    grown = {p.process: p for p in leaking.processes if not p.flat}
    assert list(grown) == ["rank 1"]
    assert grown["rank 1"].rss_growth == pytest.approx(0.081, abs=0.01)
    files = soak_report(_rows(400, fds_leak=8), warm_up=40)
    assert [p.process for p in files.processes if not p.flat] == ["rank 1"]


def test_step_time_that_drifts_fails_its_goal() -> None:
    drifting = soak_report(_rows(400, slower=0.2), warm_up=40)
    assert not drifting.step_flat
    # 20% slower from the first step to the last: about 16% between the windows' middles
    # (10-19% and 91-100% of the run) and over the steady steps' line, less the noise
    assert 0.10 < drifting.step_drift < 0.22 and 0.10 < drifting.step_fit_drift < 0.22


def test_too_short_a_run_is_refused_and_the_picture_is_drawn(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--warm-up=30: 40 steps leave 10"):
        soak_report(_rows(40), warm_up=30)
    rows = _rows(60)
    drawn = draw_soak(tmp_path / "soak.png", rows, soak_report(rows, warm_up=6))
    assert drawn is not None and drawn.read_bytes().startswith(b"\x89PNG")
