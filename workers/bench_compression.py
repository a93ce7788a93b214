"""`ray-zep bench train --compare compression`: the same steps with ZipCCL off and on.

Each case (a composition of the axes) trains K steps from the same config through
the Ray driver, like `ray-zep train`, once per `comm.compression` mode: `off`,
`auto` (the switcher picks plain or zipped per call from its start-up profile of
α, β and the codec's speed) and `always` (every call that can go zipped does).
The rows come from the runs' metrics.jsonl: steady-state step time (the first
step left out), and per stream the raw and wire bytes and the calls that went
zipped or plain. The link's α and β measured by `ray_zep.bench.calibrate` go with
the table: on a CPU over loopback, a link faster than the codec makes the
switcher rightly choose plain, and the table says so rather than forcing a win.
`ray-zep bench train` hands `--compare compression` over to `run` here; the record is
OUT/compression.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from functools import partial
from pathlib import Path

from ray_zep import steplog
from ray_zep.command_args import known, names
from ray_zep.config import Compression, load_config
from ray_zep.constants import METRICS_FILE_NAME
from ray_zep.parallel.axes import WeightsMode
from ray_zep.partition import registry
from ray_zep.partition.spec import Role
from ray_zep.report.output import BenchResult
from ray_zep.report.text_table import Column
from ray_zep.report.timeline import draw_throughput
from ray_zep_workers.steady_state import TIMING_OVERRIDES, steady_totals

FSDP = WeightsMode.FSDP.value
WHOLE, ZEPPELIN = (registry.playing(role).name for role in (Role.PACKED, Role.SYSTEM))
TAWPIPE = WeightsMode.TAWPIPE.value
WHOLE_SEQUENCES = [
    f"parallel.sequence={WHOLE}",
    "data.packing=rank",
    "parallel.routing=false",
    "parallel.remap=false",
]
CASES = {
    FSDP: [*WHOLE_SEQUENCES, f"parallel.weights={FSDP}"],
    f"{ZEPPELIN}+{FSDP}": [
        f"parallel.sequence={ZEPPELIN}",
        f"parallel.weights={FSDP}",
        "data.packing=budget",
    ],
    "moe_ep2_1a1m": [
        *WHOLE_SEQUENCES,
        "model.preset=tiny_moe",
        "parallel.ep=2",
        "parallel.moe_pipeline=1a1m",
    ],
}
CASES[TAWPIPE] = [*WHOLE_SEQUENCES, f"parallel.weights={TAWPIPE}"]
"""The compositions compared: FSDP2 over whole sequences, Zeppelin under FSDP2 (with
the routing and remapping layers where the config turns them on), an EP MoE model
with FoldMoE's 1a1m pipeline, and TawPipe's weight passing (on request)."""
DEFAULT_CASES = (FSDP, f"{ZEPPELIN}+{FSDP}", "moe_ep2_1a1m")
MODES = tuple(m.value for m in Compression)
NAME = "compression"
"""The stem of the record: `bench train --compare compression` writes OUT/compression.json."""


def run(args: argparse.Namespace) -> BenchResult:
    """`bench train --compare compression` (its flags: `bench_train.add_arguments`)."""
    cases, modes = check_cases(names(args.cases, DEFAULT_CASES), names(args.modes, MODES))
    out = Path(args.out).resolve()
    rows = run_compression_bench(args.config, args.overrides, cases, modes, args.steps, out)
    spec = {"config": args.config, "overrides": args.overrides, "steps": args.steps}
    return bench_result(rows, spec)


def bench_result(rows: list[CompressionRow], spec: dict) -> BenchResult:
    """One table line per case, mode and stream; the switch's costs under it."""
    series = [f"{r.case} {r.mode}" for r in rows]
    speeds = [r.tokens_per_second for r in rows]
    return BenchResult.from_rows(
        NAME,
        spec,
        table_rows(rows),
        COLUMNS,
        records=row_dicts(rows),
        footer=[f"{r.case} switch: {describe_profile(r.profile)}" for r in rows if r.profile],
        draw=partial(draw_throughput, "measured on this CPU", series, speeds),
    )


@dataclasses.dataclass
class CompressionRow:
    """One case under one `comm.compression` mode (steady-state steps)."""

    case: str
    mode: str
    step_seconds: float | None
    tokens_per_second: float | None
    final_loss: float | None
    streams: dict[str, dict[str, int]]
    """Per stream: raw_bytes, wire_bytes, zipped_calls, plain_calls (summed over steps)."""
    profile: dict = dataclasses.field(default_factory=dict)
    """`auto`: the costs the switch measured at start-up and decided on."""

    @property
    def raw_bytes(self) -> int:
        return sum(s["raw_bytes"] for s in self.streams.values())

    @property
    def wire_bytes(self) -> int:
        return sum(s["wire_bytes"] for s in self.streams.values())


def check_cases(cases, modes) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`cases` and `modes` if each is known.

    Raises:
        ConfigError: naming the first unknown one and the choices.
    """
    known("--cases", cases, CASES)
    known("--modes", modes, MODES)
    return tuple(cases), tuple(modes)


def run_compression_bench(
    config_path: str | None,
    overrides: list[str],
    cases: tuple[str, ...],
    modes: tuple[str, ...],
    steps: int,
    out: Path,
) -> list[CompressionRow]:
    """Train every case under every mode, `steps` steps each, side by side."""
    from ray_zep_workers.driver import train

    rows = []
    for case in cases:
        for mode in modes:
            run_dir = out / case / mode
            shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resume
            extra = [
                *CASES[case],
                f"comm.compression={mode}",
                *TIMING_OVERRIDES,
                f"train.steps={steps}",
                f"train.out_dir={run_dir}",
            ]
            summary = train(load_config(config_path, [*overrides, *extra]))
            rows.append(_row(case, mode, summary.run_dir / METRICS_FILE_NAME, summary.final_loss))
    return rows


def _row(case: str, mode: str, metrics: Path, final_loss: float | None) -> CompressionRow:
    steps = steplog.step_rows(metrics)
    steady = steps[1:]
    profile = next((r["switcher"] for r in steps if r.get("switcher")), {})
    seconds, tokens = steady_totals(steps, warm_up=1)
    streams: dict[str, dict[str, int]] = {}
    for r in steady:
        for name, counts in (r.get("compression") or {}).items():
            total = streams.setdefault(name, dict.fromkeys(counts, 0))
            for key, value in counts.items():
                total[key] += value
    return CompressionRow(
        case,
        mode,
        seconds / len(steady) if steady else None,
        tokens / seconds if seconds else None,
        final_loss,
        streams,
        profile,
    )


def table_rows(rows: list[CompressionRow]) -> list[dict]:
    """A line per case, mode and stream (one with no stream when nothing went through
    the switch), with its step time against the case's run without compression."""
    off = {r.case: r.step_seconds for r in rows if r.mode == Compression.OFF.value}
    out = []
    for r in rows:
        base = off.get(r.case)
        head = {
            "case": r.case,
            "mode": r.mode,
            "step_seconds": r.step_seconds,
            "vs_off": base / r.step_seconds if base and r.step_seconds else None,
            "tokens_per_second": r.tokens_per_second,
            "final_loss": r.final_loss,
        }
        if not r.streams:
            out.append({**head, "stream": "(nothing through the switch)"})
        for name, s in sorted(r.streams.items()):
            ratio = s["raw_bytes"] / s["wire_bytes"] if s["wire_bytes"] else None
            out.append({**head, "stream": name, **s, "ratio": ratio})
    return out


COLUMNS = (
    Column("case", "case"),
    Column("compression", "mode"),
    Column("s/step", "step_seconds", ".3f"),
    Column("vs off", lambda r: None if r["vs_off"] is None else f"{r['vs_off']:.2f}x"),
    Column("k tok/s", "tokens_per_second", ".2f", 1e3),
    Column("final loss", "final_loss", ".4f"),
    Column("stream", "stream"),
    Column("raw MB", "raw_bytes", ".2f", 1e6),
    Column("wire MB", "wire_bytes", ".2f", 1e6),
    Column("ratio", "ratio", ".3f"),
    Column("zipped", lambda r: r.get("zipped_calls", 0) if "raw_bytes" in r else None),
    Column("plain", lambda r: r.get("plain_calls", 0) if "raw_bytes" in r else None),
)


def describe_profile(profile: dict) -> str:
    """The switch's measured costs in one line: α and β of each plain collective and
    the codec's speed, which together decide plain or zipped."""
    parts = [
        f"{kind} {cost['alpha_s'] * 1e6:.0f} us + bytes / {_rate(cost['beta_s_per_byte'])}"
        for kind, cost in profile["plain"].items()
    ]
    parts.append(f"compress {_rate(profile['compress_s_per_byte'])}")
    parts.append(f"decompress {_rate(profile['decompress_s_per_byte'])}")
    return "; ".join(parts)


def _rate(seconds_per_byte: float) -> str:
    return f"{1 / seconds_per_byte / 1e9:.2f} GB/s" if seconds_per_byte > 0 else "unbounded"


def row_dicts(rows: list[CompressionRow]) -> list[dict]:
    return [
        {**dataclasses.asdict(r), "raw_bytes": r.raw_bytes, "wire_bytes": r.wire_bytes}
        for r in rows
    ]
