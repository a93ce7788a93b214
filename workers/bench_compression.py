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
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from ray_zep import steplog
from ray_zep.config import Compression, load_config
from ray_zep.constants import METRICS_FILE_NAME
from ray_zep.errors import ConfigError
from ray_zep.parallel.axes import Placement, WeightsMode
from workers.bench_train import TIMING_OVERRIDES, steady_totals

FSDP, WHOLE, ZEPPELIN = WeightsMode.FSDP.value, Placement.WHOLE.value, Placement.ZEPPELIN.value
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


def check_cases(names, modes) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """`names` and `modes` if each is known.

    Raises:
        ConfigError: naming the first unknown one and the choices.
    """
    for name in names:
        if name not in CASES:
            raise ConfigError(f"--cases: {name!r} is not one of {', '.join(CASES)}")
    for mode in modes:
        if mode not in MODES:
            raise ConfigError(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
    return tuple(names), tuple(modes)


def run_compression_bench(
    config_path: str | None,
    overrides: list[str],
    cases: tuple[str, ...],
    modes: tuple[str, ...],
    steps: int,
    out: Path,
) -> list[CompressionRow]:
    """Train every case under every mode, `steps` steps each, side by side."""
    from workers.driver import train

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


def format_table(rows: list[CompressionRow]) -> str:
    """Step time per case and mode, then bytes and calls per stream."""
    mb = 1e6
    off = {r.case: r.step_seconds for r in rows if r.mode == Compression.OFF.value}
    lines = [
        f"{'case':<16}{'compression':>12}{'s/step':>9}{'vs off':>8}{'k tok/s':>9}"
        f"{'final loss':>12}  {'stream':<20}{'raw MB':>9}{'wire MB':>9}{'ratio':>7}"
        f"{'zipped':>8}{'plain':>7}"
    ]
    for r in rows:
        base = off.get(r.case)
        speed = f"{base / r.step_seconds:.2f}x" if base and r.step_seconds else "-"
        head = (
            f"{r.case:<16}{r.mode:>12}{_num(r.step_seconds, 1, 3):>9}{speed:>8}"
            f"{_num(r.tokens_per_second, 1e3, 2):>9}{_num(r.final_loss, 1, 4):>12}  "
        )
        if not r.streams:
            lines.append(head + "(nothing through the switch)")
        for i, (name, s) in enumerate(sorted(r.streams.items())):
            ratio = s["raw_bytes"] / s["wire_bytes"] if s["wire_bytes"] else float("nan")
            lines.append(
                (head if i == 0 else " " * len(head))
                + f"{name:<20}{s['raw_bytes'] / mb:>9.2f}{s['wire_bytes'] / mb:>9.2f}"
                f"{ratio:>7.3f}{s.get('zipped_calls', 0):>8}{s.get('plain_calls', 0):>7}"
            )
    lines += [f"{r.case} switch: {describe_profile(r.profile)}" for r in rows if r.profile]
    return "\n".join(lines)


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


def _num(value: float | None, scale: float, digits: int) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def row_dicts(rows: list[CompressionRow]) -> list[dict]:
    return [
        {**dataclasses.asdict(r), "raw_bytes": r.raw_bytes, "wire_bytes": r.wire_bytes}
        for r in rows
    ]
