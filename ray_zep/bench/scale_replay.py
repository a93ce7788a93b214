"""`ray-zep bench scale-replay RECORD`: a `bench scale` record's rows played again, each
at the L, K/V room and batches the record kept for it, beside the record's step / bound.

`bench scale` plays every row at each token room and K/V room it is given and keeps the
fastest: a grid at 1,024 and 4,096 GPUs takes tens of minutes on two cores. Replaying the
rows it kept plays one room each, through the same code (`scale.case_at`: the plans, the
simulated step, its bound and where the time goes), so that a change to the planner, the
cost model or the simulator is measured on the grid's rows in a minute or two. A row
whose best room the change would move is still played at the recorded one: for the room
itself, run `bench scale` again. The footer says how the mean and the worst step / bound
moved, and which rows did.

The record's own `key=value` overrides are played again; those given here go on top of
them, so that one replay shows what a config key is worth on the grid's rows
(`ray_zep.bench.scale_overrides`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from ray_zep.bench.scale import PLACEMENTS, ScaleBenchSpec, ScaleRow, case_at, case_batches
from ray_zep.bench.scale_overrides import OVERRIDES_HELP, checked_overrides, overrides_note
from ray_zep.bench.scale_report import COLUMNS, draw_scale_chart
from ray_zep.command_args import counts, names
from ray_zep.errors import ConfigError
from ray_zep.parallel.axes import Placement
from ray_zep.remap.solver import max_flow_library
from ray_zep.report.output import BenchResult
from ray_zep.report.progress import ProgressLine

NAME = "scale-replay"
HELP = "a bench scale record's rows again, each at the room it kept"
MOVED = 0.001
"""A row's step / bound that moved by at least this is listed in the footer."""


ROW_FLAGS = {
    "gpus": ("--gpus", "cluster sizes"),
    "distribution": ("--distributions", "distributions"),
    "model": ("--models", "models"),
    "tokens_per_gpu": ("--tokens", "tokens per GPU, e.g. 4k,16k"),
}
"""A row's field, the flag that picks rows by it and what it lists."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("record", help="a `bench scale` JSON record (OUT/scale.json)")
    more = f"more key=value overrides, after the record's own {OVERRIDES_HELP}"
    parser.add_argument("overrides", nargs="*", help=more)
    parser.add_argument(
        "--placements", default=Placement.ZEPPELIN.value,
        help=f"the record's placements to replay (default {Placement.ZEPPELIN.value})",
    )  # fmt: skip
    for flag, what in ROW_FLAGS.values():
        parser.add_argument(flag, help=f"only the record's rows of these {what} (default all)")


def row_filter(args: argparse.Namespace) -> dict[str, tuple]:
    """The values each of `ROW_FLAGS` given allows, by row field (none: every row)."""
    out: dict[str, tuple] = {}
    for field, (flag, _) in ROW_FLAGS.items():
        text = getattr(args, flag[2:])
        if text is not None:
            numeric = field in ("gpus", "tokens_per_gpu")
            out[field] = counts(text, flag) if numeric else names(text, ())
    return out


def run(args: argparse.Namespace) -> BenchResult:
    path = Path(args.record)
    only = row_filter(args)
    recorded = recorded_rows(path, names(args.placements, PLACEMENTS), only)
    extra = checked_overrides(f"bench {NAME}", args.overrides)
    with ProgressLine(len(recorded), "rows", sys.stdout) as bar:
        rows = replay(recorded, extra, progress=bar.counter())
    footer = compare(recorded, rows, extra)
    spec = {
        "record": str(path),
        "placements": args.placements,
        "overrides": list(extra),
        **{ROW_FLAGS[field][0][2:]: list(values) for field, values in only.items()},
    }
    own = recorded[0].get("overrides", [])
    return BenchResult.from_rows(NAME, spec, rows, COLUMNS, draw_scale_chart, key_columns=5,
                                 footer=footer, notes=overrides_note([*own, *extra]))  # fmt: skip


def recorded_rows(path: Path, placements: tuple[str, ...], only: dict | None = None) -> list[dict]:
    """The rows of the record at `path` to replay: those of `placements` that ran (and whose
    fields hold one of `only`'s values, `row_filter`), with the record's batches,
    micro-batches, plan repeats and overrides.

    Raises:
        ConfigError: the file is missing, not JSON, or not a `bench scale` record.
    """
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"scale-replay RECORD {path}: {exc}") from None
    rows = record.get("rows") if isinstance(record, dict) else None
    spec = record.get("spec") if isinstance(record, dict) else None
    if not isinstance(rows, list) or not isinstance(spec, dict) or "tokens_per_gpu" not in spec:
        raise ConfigError(f"scale-replay RECORD {path}: not a `ray-zep bench scale` record "
                          "(OUT/scale.json)")  # fmt: skip
    keys = ("batches", "micro_batches", "plan_only", "plan_repeats", "overrides")
    kept = {key: spec[key] for key in keys if key in spec}
    only = only or {}
    out = [dict(row, **kept) for row in rows
           if isinstance(row, dict) and row.get("placement") in placements
           and row.get("error") is None and row.get("tokens_per_rank")
           and all(row.get(field) in values for field, values in only.items())]  # fmt: skip
    if not out:
        wanted = " ".join([f"--placements {','.join(placements)}",
                           *(f"{ROW_FLAGS[field][0]} {','.join(map(str, values))}"
                             for field, values in only.items())])  # fmt: skip
        raise ConfigError(f"scale-replay RECORD {path}: no row of {wanted} ran with its L "
                          "recorded (tokens_per_rank)")  # fmt: skip
    return out


def replay(recorded: list[dict], extra: tuple[str, ...] = (), progress=print) -> list[ScaleRow]:
    """Each recorded row played again at its L and K/V room, under the record's overrides
    and `extra` (module docstring). The first is played twice and its second play kept:
    the first pays for what a process loads once (the planner's compiled kernels, the
    max-flow solver), in no row's planner time, as `bench scale` keeps it out of its
    rows'."""
    max_flow_library()
    rows, batches = [], {}
    for row in recorded[:1]:
        _play(row, batches, extra)
    for row in recorded:
        rows += _play(row, batches, extra)
        tokens = int(row["tokens_per_gpu"]) // 1024
        progress(f"{row['gpus']} GPUs {row['distribution']} {row['model']} {tokens}k/GPU "
                 f"L={row['tokens_per_rank']}")  # fmt: skip
    return rows


def _play(row: dict, batches: dict, extra: tuple[str, ...]) -> list[ScaleRow]:
    """One recorded row at its L and K/V room, under its record's overrides and `extra`
    (`batches`: each case's, drawn once)."""
    gpus, tokens = int(row["gpus"]), int(row["tokens_per_gpu"])
    distribution, model = row["distribution"], row["model"]
    key = (distribution, tokens * gpus, int(row.get("batches", 1)))
    if key not in batches:
        batches[key] = case_batches(distribution, tokens * gpus, key[2])
    spec = ScaleBenchSpec(
        gpus=(gpus,), distributions=(distribution,), models=(model,),
        tokens_per_gpu=(tokens,), placements=(row["placement"],), batches=key[2],
        headroom=headroom_for(int(row["tokens_per_rank"]), tokens),
        plan_only=bool(row.get("plan_only", False)),
        plan_repeats=int(row.get("plan_repeats", 1)),
        micro_batches=int(row.get("micro_batches", 1)),
        overrides=(*row.get("overrides", ()), *extra),
    )  # fmt: skip
    return case_at(spec, gpus, distribution, model, tokens, batches[key], row.get("kv_room_mb"))


def headroom_for(capacity: int, tokens: int) -> float:
    """The headroom whose L (`ceil(tokens x headroom)`, as `scale.case_at` takes it) is
    `capacity`."""
    headroom = capacity / tokens
    while math.ceil(tokens * headroom) > capacity:
        headroom = math.nextafter(headroom, 0.0)
    return headroom


def compare(recorded: list[dict], rows: list[ScaleRow], extra: tuple[str, ...] = ()) -> list[str]:
    """The footer: step / bound, recorded and now (under `extra` overrides where given),
    mean and worst, and the rows that moved."""
    pairs = [(before, now) for before, now in zip(recorded, rows, strict=True)
             if before.get("step_over_bound") and now.step_over_bound]  # fmt: skip
    if not pairs:
        return ["no simulated row to compare (a --plan-only record, or every row failed)"]
    was = [b["step_over_bound"] for b, _ in pairs]
    now = [n.step_over_bound for _, n in pairs]
    under = f" (now with {' '.join(extra)})" if extra else ""
    lines = [f"step / bound against the record{under}, {len(pairs)} rows: mean "
             f"{statistics.mean(was):.4f} -> {statistics.mean(now):.4f}, worst "
             f"{max(was):.4f} -> {max(now):.4f}"]  # fmt: skip
    for (before, after), a, b in zip(pairs, was, now, strict=True):
        if abs(b - a) >= MOVED:
            change = 100 * (after.step_s / before["step_s"] - 1)
            case = f"{before['gpus']} GPUs {before['distribution']} {before['model']}"
            lines.append(f"  {case} {before['placement']}: {a:.4f} -> {b:.4f} "
                         f"({change:+.1f}% step)")  # fmt: skip
    return lines
