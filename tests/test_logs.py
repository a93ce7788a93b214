"""The logging set-up that every command performs (`setup_logging`)."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

import pytest

from ray_zep.cli import main
from ray_zep.logs import LOGGERS, CurrentStderrHandler, setup_logging

pytestmark = pytest.mark.unit


def _our_handlers() -> list[list[logging.Handler]]:
    return [
        [h for h in logging.getLogger(n).handlers if isinstance(h, CurrentStderrHandler)]
        for n in LOGGERS
    ]


def test_a_command_run_twice_with_its_stderr_closed_between_logs_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    assert main(["report", str(tmp_path)]) == 2  # a command: sets up logging, then fails
    first.close()  # what a test runner does with the stream it captured
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("ray_zep.report").warning("between the two commands")
    assert main(["report", str(tmp_path)]) == 2
    logging.getLogger("ray_zep_workers.driver").warning("after the second command")
    text = second.getvalue()
    assert "Logging error" not in text and "closed file" not in text, text
    assert "between the two commands" in text and "after the second command" in text, text
    assert [len(h) for h in _our_handlers()] == [1, 1], "a second set-up adds no handler"


def test_set_up_keeps_handlers_it_did_not_install() -> None:
    logger = logging.getLogger("ray_zep")
    records: list[logging.LogRecord] = []
    theirs = logging.Handler()
    theirs.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(theirs)
    setup_logging(None)
    setup_logging(rank=1)
    assert theirs in logger.handlers and [len(h) for h in _our_handlers()] == [1, 1]
    logging.getLogger("ray_zep.x").warning("seen by both")
    assert [r.getMessage() for r in records] == ["seen by both"]
    assert logger.level == logging.WARNING, "a rank other than 0 logs quietly"
