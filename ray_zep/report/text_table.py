"""Every bench's terminal table: columns declared once, drawn by `rich` as a Markdown
table (aligned in a terminal and in a log file, and pasted into BENCHMARKS.md as is)."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

MISSING = "-"


@dataclass(frozen=True)
class Column:
    """One column: its header, how a row gives its value, and how the value prints."""

    label: str
    value: str | Callable[[Any], Any]
    """An attribute (or dict key) of the row, or a function of the row."""
    fmt: str = ""
    """A format spec for numbers (".2f", ">+.1%"); text prints as it is."""
    scale: float = 1.0
    """Numbers are divided by this first (1e3: k, 2**20: MiB)."""

    def cell(self, row: Any) -> str:
        value = self.value(row) if callable(self.value) else _field(row, self.value)
        if value is None:
            return MISSING
        if isinstance(value, int | float) and not isinstance(value, bool):
            return format(value / self.scale if self.scale != 1 else value, self.fmt)
        return str(value)


def render_table(
    rows: Iterable[Any], columns: Sequence[Column], *, key_columns: int = 0, error: str = "error"
) -> str:
    """The rows as an aligned table; text columns align left, numbers right.

    A row whose `error` field is set gets one line under the table instead: its first
    `key_columns` cells, then the error.
    """
    rows = list(rows)
    good = [r for r in rows if not _field(r, error)]
    table = Table(box=box.MARKDOWN, header_style=None, highlight=False)
    cells = [[c.cell(r) for c in columns] for r in good]
    for i, column in enumerate(columns):
        numeric = cells and all(_numeric(line[i]) for line in cells)
        table.add_column(column.label, justify="right" if numeric else "left")
    for line in cells:
        table.add_row(*line)
    console = Console(file=io.StringIO(), width=1000, color_system=None, soft_wrap=False)
    console.print(table)
    lines = [line.rstrip() for line in console.file.getvalue().splitlines() if line.strip()]
    for r in rows:
        if _field(r, error):
            case = " ".join(c.cell(r) for c in columns[:key_columns])
            lines.append(f"{case}: {_field(r, error)}")
    return "\n".join(lines)


def _field(row: Any, name: str) -> Any:
    return row.get(name) if isinstance(row, dict) else getattr(row, name, None)


def _numeric(text: str) -> bool:
    if text == MISSING:
        return True
    try:
        float(text.rstrip("x%").replace(",", ""))
    except ValueError:
        return False
    return True
