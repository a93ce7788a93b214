"""Where benchmark results go: the table printed, a JSON record with the machine and
command, and a PNG; one writer (`publish`) for every `ray-zep bench`, and one way for a
bench to state its rows as such a result (`BenchResult.from_rows`)."""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ray_zep.report.text_table import Column, render_table


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch  # here only: the CLI starts without it (its commands import it as they need)

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "gpu": gpu, "torch": torch.__version__}


def write_record(path: Path, command: str, record: dict[str, Any]) -> Path:
    """`record` with the command, date and machine added, as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stamped = {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        **record,
    }
    path.write_text(json.dumps(stamped, indent=1) + "\n")
    return path


@dataclass
class BenchResult:
    """What a bench returns: the one writer (`publish`) prints and saves it."""

    name: str
    """The stem of its JSON and PNG files (`<out>/<name>.json`)."""
    spec: dict[str, Any]
    """What was asked: flags and the config's presets, recorded in the JSON."""
    rows: list[dict[str, Any]]
    table: str
    notes: list[str] = field(default_factory=list)
    """Lines printed before the table (what it was simulated on, skipped codecs)."""
    footer: list[str] = field(default_factory=list)
    """Lines printed after the table (per-case ratios, the switch's costs)."""
    goals: list[tuple[str, bool]] = field(default_factory=list)
    """(goal, met) pairs, printed and recorded."""
    record: dict[str, Any] = field(default_factory=dict)
    """More keys for the JSON record (measured ratios, CPU runs beside the model)."""
    draw: Callable[[Path], Path | None] | None = None
    """Draws the PNG at the path given; returns None when matplotlib is missing."""
    written: list[Path] = field(default_factory=list)
    """Files the bench saved itself (a calibration.json)."""

    @classmethod
    def from_rows(
        cls,
        name: str,
        spec: dict[str, Any],
        rows: Sequence[Any],
        columns: Sequence[Column],
        chart: Callable[[Sequence[Any], Path], Path | None] | None = None,
        *,
        key_columns: int = 0,
        records: list[dict[str, Any]] | None = None,
        **more: Any,
    ) -> BenchResult:
        """The result of a bench whose table shows its rows.

        Args:
            name, spec: as the fields.
            rows: the table's rows (dataclasses or dicts, `render_table`).
            columns: the table's columns; `key_columns` of them name a failed row.
            chart: draws the rows' PNG, `chart(rows, path)`; None: no PNG, or `draw`
                in `more`.
            records: the rows as recorded in the JSON; None: `asdict` of each row.
            more: the other fields (notes, footer, goals, record, draw, written).
        """
        if chart is not None:
            more["draw"] = partial(chart, rows)
        return cls(
            name,
            spec,
            [asdict(r) for r in rows] if records is None else records,
            render_table(rows, columns, key_columns=key_columns),
            **more,
        )


def publish(
    result: BenchResult, out: Path, command: str, json_path: Path | None = None
) -> list[Path]:
    """Print the result's table with its notes and goals; write its JSON record and PNG
    (OUT/NAME.json and OUT/NAME.png, or `json_path` and the PNG of its name beside it, so
    that a second run into the same folder keeps the first one's picture).

    Returns:
        Every file written, in the order printed.
    """
    for line in [*result.notes, result.table, *result.footer]:
        print(line)
    for goal, met in result.goals:
        print(f"goal {'met' if met else 'MISSED'}: {goal}")
    record = {"spec": result.spec, "rows": result.rows, **result.record}
    if result.goals:
        record["goals"] = [{"goal": goal, "met": bool(met)} for goal, met in result.goals]
    json_path = json_path or out / f"{result.name}.json"
    paths = [*result.written, write_record(json_path, command, record)]
    if result.draw is not None:
        picture = result.draw(json_path.with_suffix(".png"))
        if picture is not None:
            paths.append(picture)
    for path in paths:
        print(f"wrote {path}")
    return paths
