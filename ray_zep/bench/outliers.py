"""`ray-zep bench outliers`: outlier delay against none on the configured data's stream,
modelled, as `ray-zep plan --auto` plays it.

For each cluster size, data mix and model: the default placement (zeppelin + fsdp, budget
packing at `data.batch_fill` 0.8, L = 1.25 x the tokens per GPU) on the synthetic mix's
stream, played with `data.outlier_tokens` at each threshold `ray_zep.sim.outlier_choice`
tries, on a window that ends with no outlier held, beside itself without the delay on as
many batches (`ray_zep.sim.auto.delayed_candidates`, the code `plan --auto` runs). The
table gives both windows' tokens/s per GPU and the delay's gain; the PNG the gains.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ray_zep.command_args import cluster_a_config, names
from ray_zep.config import Config
from ray_zep.data.synthetic import DISTRIBUTIONS
from ray_zep.report.charts import grouped_bars
from ray_zep.report.figures import save_figure
from ray_zep.report.output import BenchResult
from ray_zep.report.text_table import Column
from ray_zep.sim.auto import AutoPlan, delayed_candidates, evaluate_group
from ray_zep.sim.outlier_choice import MIN_WINDOW, RARE_EVERY, SPAN_NODES
from ray_zep.sim.replay import data_batches
from ray_zep.sim.request import request_hardware

NAME = "outliers"
HELP = "outlier delay against none on a data stream, modelled"
GPUS_PER_NODE = 8
HEADROOM = 1.25
FILL = 0.8


@dataclass(frozen=True)
class OutlierRow:
    gpus: int
    data: str
    model: str
    threshold: int | None
    """`data.outlier_tokens`; None where no threshold applies (too few long documents)."""
    batches: int | None = None
    """Batches of the window both streams played."""
    outliers: int | None = None
    """Documents of the window at least `threshold` long."""
    plain_tokens_per_s_per_gpu: float | None = None
    delayed_tokens_per_s_per_gpu: float | None = None
    held_at_end: int | None = None
    fits: bool | None = None
    note: str = ""

    @property
    def gain(self) -> float | None:
        plain, delayed = self.plain_tokens_per_s_per_gpu, self.delayed_tokens_per_s_per_gpu
        return delayed / plain - 1 if plain and delayed else None


COLUMNS = [
    Column("GPUs", "gpus"),
    Column("data", "data"),
    Column("model", "model"),
    Column("outlier_tokens", "threshold", ",d"),
    Column("batches", "batches"),
    Column("outliers", "outliers"),
    Column("tok/s/GPU plain", "plain_tokens_per_s_per_gpu", ",.0f"),
    Column("tok/s/GPU delayed", "delayed_tokens_per_s_per_gpu", ",.0f"),
    Column("gain", "gain", "+.1%"),
    Column("held at end", "held_at_end"),
    Column("fits", lambda r: None if r.fits is None else ("yes" if r.fits else "NO")),
    Column("note", "note"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config (defaults if omitted)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument("--gpus", default="256,1024", help="cluster sizes (GPUs, 8 a node)")
    parser.add_argument("--data", default=",".join(DISTRIBUTIONS), help="synthetic mixes")
    parser.add_argument("--models", default="7b", help="model presets")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per GPU (L: x 1.25)")
    least = f"batches each window holds at least (never fewer than {MIN_WINDOW})"
    parser.add_argument("--batches", type=int, default=MIN_WINDOW, help=least)


def run(args: argparse.Namespace) -> BenchResult:
    gpus = [int(g) for g in names(args.gpus, ())]
    rows = []
    for size in gpus:
        for model in names(args.models, ()):
            for data in names(args.data, ()):
                config = case_config(args, size, model, data, args.tokens)
                rows += case_rows(config, size, model, data, args.batches)
    spec = {"gpus": gpus, "data": args.data, "models": args.models, "tokens": args.tokens,
            "batches": args.batches, "batch_fill": FILL, "headroom": HEADROOM}  # fmt: skip
    gains = [r.gain for r in rows if r.gain is not None]
    notes = [
        f"cluster A, zeppelin + fsdp, budget packing at fill {FILL}, L = {HEADROOM} x "
        f"{args.tokens} tokens per GPU; thresholds: {SPAN_NODES} nodes' L and the length "
        f"one document in {RARE_EVERY} batches reaches, where the first batches hold at least "
        "data.outlier_group documents that long"
    ]
    footer = [f"delay gain over the cases: {min(gains):+.1%} to {max(gains):+.1%}"] if gains else []
    return BenchResult.from_rows(NAME, spec, rows, COLUMNS, draw, notes=notes, footer=footer,
                                 key_columns=4)  # fmt: skip


def case_config(args: argparse.Namespace, gpus: int, model: str, data: str, tokens: int) -> Config:
    """The case's config: cluster A under the user's config and overrides, then the case."""
    case = [f"topology.nodes={gpus // GPUS_PER_NODE}", f"topology.gpus_per_node={GPUS_PER_NODE}",
            f"model.preset={model}", f"train.tokens_per_rank={math.ceil(tokens * HEADROOM)}",
            "parallel.sequence=zeppelin", "parallel.weights=fsdp", "data.packing=budget",
            f"data.batch_fill={FILL}", f"data.source=synthetic:{data}"]  # fmt: skip
    own = argparse.Namespace(config=args.config, overrides=[*args.overrides, *case])
    return cluster_a_config(own)


def case_rows(config: Config, gpus: int, model: str, data: str, count: int) -> list[OutlierRow]:
    """One row per threshold tried (or one saying why none was)."""
    hardware, on_gpu = request_hardware(config, None)

    def data_of(candidate: Config, batches: int):
        return data_batches(candidate, hardware.devices, 0, batches)

    searched = evaluate_group([config], hardware, data_of(config, count), on_gpu)
    if not searched[0].steps:
        return [OutlierRow(gpus, data, model, None, note=searched[0].error or "not placed")]
    tried = delayed_candidates(AutoPlan(searched), config, hardware, data_of, on_gpu, count)
    if not tried:
        few = f"too few documents span {SPAN_NODES} nodes"
        return [OutlierRow(gpus, data, model, None, note=few)]
    rows = []
    for candidate in tried:
        delay = candidate.delay
        threshold = candidate.config.data.outlier_tokens
        if delay is None:
            rows.append(OutlierRow(gpus, data, model, threshold, note=candidate.error or ""))
            continue
        rows.append(OutlierRow(gpus, data, model, threshold, delay.batches, delay.outliers,
                               delay.plain_tokens_per_second / gpus,
                               delay.delayed_tokens_per_second / gpus, delay.held_at_end,
                               candidate.fits, "not ranked: outliers held" if delay.held_at_end
                               else ""))  # fmt: skip
    return rows


def draw(rows: list[OutlierRow], path: Path) -> Path | None:
    """The delay's gain per case and threshold, percent."""
    return save_figure(path, partial(_draw, rows), size=(10.0, 4.4))


def _draw(rows: list[OutlierRow], figure: Any, axes: Any) -> None:
    shown = [r for r in rows if r.gain is not None]
    groups = [f"{r.gpus} {r.data} {r.model}\n{r.threshold // 1024}k" for r in shown]
    values = [[100 * r.gain] for r in shown]
    grouped_bars(axes[0, 0], groups, ["delay's gain"], values,
                 title="outlier delay: tokens/s against none, same documents (modelled)",
                 ylabel="% tokens/s", xlabel="case, data.outlier_tokens")  # fmt: skip
