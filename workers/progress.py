"""Progress of `ray-zep train`: step, loss, tokens/s, time left.

On a terminal a bar redraws in place; otherwise (logs of `ray job submit`) a line
is printed about every 5% of the run and at the end (`ray_zep.report.progress`).
"""

from __future__ import annotations

import time
from typing import Any, TextIO

from ray_zep.report.progress import ProgressLine


class ProgressBar:
    def __init__(self, total_steps: int, enabled: bool = True, stream: TextIO | None = None):
        self.total = total_steps
        self.enabled = enabled
        self.stream = stream
        self._line: ProgressLine | None = None
        self._first_step = 0
        self._started = time.perf_counter()
        self._tokens = 0

    def start(self, step: int) -> None:
        self._first_step = step
        self._started = time.perf_counter()
        self._tokens = 0
        if not self.enabled:
            return
        if self._line is None:
            every = max(1, self.total // 20)
            self._line = ProgressLine(self.total, "step", self.stream, every, head=False)
        if step:
            self._line.note(f"resuming after step {step}/{self.total}")

    def update(self, row: dict[str, Any]) -> None:
        self._tokens += row["tokens"]
        if self._line is None:
            return
        self._line.update(row["step"], self._status(row))
        if row["step"] == self.total:
            self._line.close()

    def close(self) -> None:
        """Stop the bar (a run that ends early or fails leaves no bar drawn)."""
        if self._line is not None:
            self._line.close()

    @property
    def tokens(self) -> int:
        """Tokens trained since `start`."""
        return self._tokens

    def average_tokens_per_second(self) -> float:
        return self._tokens / max(1e-9, time.perf_counter() - self._started)

    def _status(self, row: dict[str, Any]) -> str:
        step = row["step"]
        done = step - self._first_step
        eta = (time.perf_counter() - self._started) / max(1, done) * (self.total - step)
        return (
            f"step {step:>{len(str(self.total))}}/{self.total} "
            f"loss {row['loss']:.4f} | {row['tokens_per_second'] / 1e3:.1f}k tok/s "
            f"(avg {self.average_tokens_per_second() / 1e3:.1f}k) | "
            f"{row['step_seconds']:.2f} s/step | eta {_clock(eta)}"
        )


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
