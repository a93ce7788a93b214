"""Progress of a long command: a bar redrawn in place on a terminal (`rich`), a plain
line per update where the output is a log (`ray job submit`, CI, a file)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class ProgressLine:
    """`update(done, status)` after each unit of `total`; `close()` at the end, or the
    line as a context manager, closed when its block ends (`with ProgressLine(...) as
    bar: rows = run(..., bar.counter())`).

    Args:
        total: units of work (steps, cases).
        label: what is counted, shown before the bar.
        stream: where it goes (stderr by default).
        every: off a terminal, print only every `every`-th unit, the first, the last, and
            any that ends `QUIET_SECONDS` or more after the last line printed.
        head: off a terminal, start each line with `[done/total label, elapsed]` (False
            where the status says how far it got itself).
    """

    def __init__(
        self,
        total: int,
        label: str,
        stream: TextIO | None = None,
        every: int = 1,
        head: bool = True,
    ) -> None:
        self.total, self.every = max(1, total), max(1, every)
        self.stream = stream or sys.stderr
        self.label, self.head = label, head
        self._start = self._printed = time.monotonic()
        self._bar: Progress | None = None
        if self.stream.isatty():
            self._bar = Progress(
                TextColumn(label),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
            )
            self._task = self._bar.add_task(label, total=self.total, status="")
            self._bar.start()

    def update(self, done: int, status: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, status=status)
            return
        now = time.monotonic()
        quiet = now - self._printed >= QUIET_SECONDS
        if done % self.every == 0 or done in (1, self.total) or quiet:
            self._printed = now
            if self.head:
                status = f"[{done}/{self.total} {self.label}, {_clock(now - self._start)}] {status}"
            print(status, file=self.stream, flush=True)

    def counter(self) -> Callable[[str], None]:
        """A callback for code that reports each finished unit as a line: it counts them."""
        done = 0

        def report(status: str) -> None:
            nonlocal done
            done += 1
            self.update(done, status)

        return report

    def note(self, line: str) -> None:
        """A line that stays (above the bar on a terminal)."""
        if self._bar is not None:
            self._bar.console.print(line, highlight=False, markup=False)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


QUIET_SECONDS = 60.0
"""Off a terminal, the longest a `ProgressLine` stays silent while units end."""


def _clock(seconds: float) -> str:
    """`12s`, `3m05s`, `1h02m`."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
