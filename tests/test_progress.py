"""Progress off a terminal: a line every `every` units, the first and the last; the
training bar's lines carry step, loss and throughput."""

from __future__ import annotations

import io

import pytest

from ray_zep.report import progress
from ray_zep.report.progress import ProgressLine
from ray_zep_workers.progress import ProgressBar

pytestmark = pytest.mark.unit


def test_a_log_gets_every_nth_line_and_the_first_and_last() -> None:
    stream = io.StringIO()
    line = ProgressLine(10, "cases", stream, every=4)
    report = line.counter()
    for i in range(10):
        report(f"case {i + 1}")
    line.close()
    lines = stream.getvalue().splitlines()
    assert lines == [f"[{n}/10 cases, 0s] case {n}" for n in (1, 4, 8, 10)]


def test_a_log_gets_a_line_after_a_quiet_minute(monkeypatch) -> None:
    clock = iter([0.0, 5.0, 70.0, 75.0])  # the line's start, then three units' ends
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    stream = io.StringIO()
    line = ProgressLine(10, "groups", stream, every=5)
    report = line.counter()
    for i in range(3):
        report(f"group {i + 1}")
    assert stream.getvalue().splitlines() == [
        "[1/10 groups, 5s] group 1",
        "[2/10 groups, 1m10s] group 2",  # 65 s after the last line
    ]


def test_a_block_reports_its_units_through_the_counter() -> None:
    stream = io.StringIO()
    with ProgressLine(3, "cases", stream) as line:
        report = line.counter()
        for i in range(3):
            report(f"case {i + 1}")
    assert stream.getvalue().splitlines() == [f"[{n}/3 cases, 0s] case {n}" for n in (1, 2, 3)]


def test_training_progress_in_a_log() -> None:
    stream = io.StringIO()
    bar = ProgressBar(40, stream=stream)
    bar.start(20)
    for step in range(21, 41):
        bar.update({"step": step, "tokens": 100, "loss": 2.5, "tokens_per_second": 4e3,
                    "step_seconds": 0.5})  # fmt: skip
    lines = stream.getvalue().splitlines()
    assert lines[0] == "resuming after step 20/40"
    assert lines[1].startswith("step 22/40 loss 2.5000 | 4.0k tok/s") and "eta " in lines[1]
    assert lines[-1].startswith("step 40/40") and len(lines) == 11  # every 2nd step
    assert bar.tokens == 2000
