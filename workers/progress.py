"""Progress bar of `ray-zep train`: step, loss, tokens/s, time left.

On a terminal the bar redraws in place; otherwise (logs of `ray job submit`)
it prints a line about every 5% of the run and at the end.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

BAR_WIDTH = 24


class ProgressBar:
    def __init__(self, total_steps: int, enabled: bool = True, stream: TextIO | None = None):
        self.total = total_steps
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self.every = max(1, total_steps // 20)
        self._first_step = 0
        self._started = time.perf_counter()
        self._tokens = 0

    def start(self, step: int) -> None:
        self._first_step = step
        self._started = time.perf_counter()
        self._tokens = 0
        if self.enabled and step:
            self._write(f"resuming after step {step}/{self.total}", newline=True)

    def update(self, row: dict[str, Any]) -> None:
        self._tokens += row["tokens"]
        if not self.enabled:
            return
        step = row["step"]
        if not self.interactive and step % self.every and step != self.total:
            return
        self._write(self._line(row), newline=not self.interactive or step == self.total)

    @property
    def tokens(self) -> int:
        """Tokens trained since `start`."""
        return self._tokens

    def average_tokens_per_second(self) -> float:
        return self._tokens / max(1e-9, time.perf_counter() - self._started)

    def _line(self, row: dict[str, Any]) -> str:
        step = row["step"]
        filled = round(BAR_WIDTH * step / self.total)
        done = step - self._first_step
        elapsed = time.perf_counter() - self._started
        eta = elapsed / max(1, done) * (self.total - step)
        return (
            f"step {step:>{len(str(self.total))}}/{self.total} "
            f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
            f"loss {row['loss']:.4f} | {row['tokens_per_second'] / 1e3:.1f}k tok/s "
            f"(avg {self.average_tokens_per_second() / 1e3:.1f}k) | "
            f"{row['step_seconds']:.2f} s/step | eta {_clock(eta)}"
        )

    def _write(self, text: str, newline: bool) -> None:
        prefix = "\r\x1b[2K" if self.interactive else ""
        self.stream.write(prefix + text + ("\n" if newline else ""))
        self.stream.flush()


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
