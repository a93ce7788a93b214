"""`ray-zep bench zipccl`: measured ratios in, modelled rows, table, JSON and PNG out.

The ratios come from our codec (`ray_zep.collectives.compress`) on this machine:
BF16 weights of one Llama3-8B-shaped block initialised like `ray_zep.model`
does, and the demo model's BF16 hidden states and gradients after a few CPU
training steps (the tensors of `ray-zep bench codec`'s model rows).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ray_zep.bench.zipccl import LLAMA3_8B, SETUPS, Assumptions, DenseModel, Ratios, Setup
from ray_zep.bench.zipccl_model import codec_bytes_s, model_step
from ray_zep.collectives import compress
from ray_zep.config import load_config
from ray_zep.errors import ConfigError
from ray_zep.model.llama import INIT_STD, Block
from ray_zep.model_shapes import ModelShape
from ray_zep.report.charts import grouped_bars
from ray_zep.report.figures import save_figure
from ray_zep.report.output import BenchResult
from ray_zep.report.text_table import Column

NAME = "zipccl"
HELP = "ZipCCL's paper setups, modelled off and on"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mfu", type=float, default=0.58, help="model FLOPs / peak (0.58)")
    parser.add_argument(
        "--codec-dram-fraction", type=float, default=0.5, help="codec rate / DRAM rate (0.5)"
    )
    parser.add_argument("--latency-us", type=float, default=10.0, help="alpha per ring step")
    parser.add_argument(
        "--weights-sample", type=int, default=0, help="values per weight tensor measured (0: all)"
    )
    parser.add_argument("--demo-config", default="conf/demo.yaml", help="model of the demo ratios")
    parser.add_argument(
        "--demo-steps", type=int, default=3, help="demo training steps (0: weights' ratio only)"
    )


def run(args: argparse.Namespace) -> BenchResult:
    if args.demo_steps < 0:
        raise ConfigError(f"--demo-steps={args.demo_steps}: must be >= 0 (0: no demo run)")
    assumptions = Assumptions(args.mfu, args.codec_dram_fraction, args.latency_us)
    weights = layer_weights(sample=args.weights_sample)
    demo = None
    if args.demo_steps:
        from ray_zep.bench.codec import model_tensors

        demo = model_tensors(load_config(Path(args.demo_config), []), args.demo_steps)
    ratios = measure_ratios(weights, demo)
    rows = model_rows(assumptions, ratios)
    spec = {key: getattr(args, key) for key in ("weights_sample", "demo_config", "demo_steps")}
    return BenchResult.from_rows(
        NAME,
        spec,
        rows,
        COLUMNS,
        draw_zipccl_chart,
        notes=[f"measured ratios (our codec, this machine): {asdict(ratios)}"],
        record={
            "assumptions": asdict(assumptions),
            "ratios": asdict(ratios)
            | {"weights_values": weights.numel(), "demo_steps": args.demo_steps},
        },
    )


def layer_weights(model: DenseModel = LLAMA3_8B, sample: int = 0) -> torch.Tensor:
    """BF16 weights of one block of `model`, drawn as `Transformer.init_weights` draws them.

    Args:
        sample: values kept per parameter tensor (its first ones); 0 keeps all.
    """
    if sample < 0:
        raise ConfigError(f"bench zipccl --weights-sample={sample}: must be >= 0 (0 = all)")
    shape = ModelShape(model.vocab, model.dim, model.layers, model.heads, model.kv_heads,
                       model.ffn)  # fmt: skip
    with torch.device("meta"):
        block = Block(shape, 0)
    generator = torch.Generator().manual_seed(0)
    residual_std = INIT_STD / math.sqrt(2 * model.layers)
    parts = []
    for name, param in block.named_parameters():
        numel = param.numel() if sample == 0 else min(sample, param.numel())
        if name.endswith("norm.weight"):
            parts.append(torch.ones(numel))
            continue
        std = residual_std if name.endswith(("wo.weight", "w2.weight")) else INIT_STD
        parts.append(torch.randn(numel, generator=generator) * std)
    return torch.cat(parts).bfloat16()


def measure_ratios(weights: torch.Tensor, demo: dict[str, torch.Tensor] | None) -> Ratios:
    """Our codec's ratios on the payloads; without `demo` tensors the weights' ratio stands
    in for activations and gradients."""
    ratio_w = compress(weights).ratio
    if demo is None:
        return Ratios(ratio_w, ratio_w, ratio_w)
    return Ratios(ratio_w, compress(demo["hidden states"]).ratio, compress(demo["gradients"]).ratio)


@dataclass(frozen=True)
class ZipCCLRow:
    """One setup, modelled off (NCCL) and on (ZipCCL); seconds per step, GB per step.

    `comm_*`: the collectives the paper's communication figure times (FSDP all-gathers,
    MoE all-to-alls); `other_comm_*`: FSDP reduce-scatters / MoE gradient all-reduce;
    `nic_gb_*`: the `comm` collectives' bytes through one node's NIC; `*_diff`:
    modelled minus paper speedup.
    """

    setup: str
    model: str
    testbed: str
    gpus: int
    compute_s: float
    step_off_s: float
    step_on_s: float
    e2e_speedup: float
    comm_off_s: float
    comm_on_s: float
    comm_speedup: float
    other_comm_off_s: float
    other_comm_on_s: float
    nic_gb_off: float
    nic_gb_on: float
    codec_gbytes_s: float
    paper_e2e: float | None
    paper_comm: float | None
    e2e_diff: float | None
    comm_diff: float | None
    paper_approximate: bool
    paper_source: str


def model_row(setup: Setup, spec: Assumptions, ratios: Ratios) -> ZipCCLRow:
    off, on = model_step(setup, spec, None), model_step(setup, spec, ratios)
    e2e, comm = off.step_s / on.step_s, off.collective_s / on.collective_s
    ratio = ratios.weights if isinstance(setup.model, DenseModel) else ratios.activations
    return ZipCCLRow(
        setup.name, setup.model.name, setup.testbed.name, setup.gpus, off.compute_s,
        off.step_s, on.step_s, e2e, off.collective_s, on.collective_s, comm,
        off.other_comm_s, on.other_comm_s, off.nic_bytes / 1e9, on.nic_bytes / 1e9,
        codec_bytes_s(setup, ratio, spec) / 1e9, setup.paper_e2e, setup.paper_comm,
        None if setup.paper_e2e is None else e2e - setup.paper_e2e,
        None if setup.paper_comm is None else comm - setup.paper_comm,
        setup.approximate, setup.source,
    )  # fmt: skip


def model_rows(spec: Assumptions, ratios: Ratios, setups=SETUPS) -> list[ZipCCLRow]:
    return [model_row(setup, spec, ratios) for setup in setups]


def _x(value: float | None, approximate: bool = False) -> str | None:
    if value is None:
        return None
    return f"{'~' if approximate else ''}{value:.2f}x"


COLUMNS = (
    Column("setup (modelled)", "setup"),
    Column("GPUs", "gpus"),
    Column("compute s", "compute_s", ".3f"),
    Column("other s", "other_comm_off_s", ".3f"),
    Column("step off s", "step_off_s", ".3f"),
    Column("step on s", "step_on_s", ".3f"),
    Column("e2e", lambda r: _x(r.e2e_speedup)),
    Column("comm", lambda r: _x(r.comm_speedup)),
    Column("paper e2e", lambda r: _x(r.paper_e2e, r.paper_approximate)),
    Column("paper comm", lambda r: _x(r.paper_comm, r.paper_approximate)),
    Column("d e2e", "e2e_diff", "+.2f"),
    Column("d comm", "comm_diff", "+.2f"),
)
"""Modelled step off/on and speedups next to the paper's (~: "around" in the paper).
`other s`: the collectives outside the paper's communication figure, NCCL (FSDP
reduce-scatters, MoE gradient all-reduce)."""


def draw_zipccl_chart(rows: list[ZipCCLRow], path: Path) -> Path | None:
    """Modelled and paper speedups per setup: end to end, then communication.

    Returns:
        `path`, or None when matplotlib is not installed (the picture is skipped).
    """
    return save_figure(path, partial(_draw_zipccl, rows), size=(14.0, 7.6), rows=2)


def _draw_zipccl(rows: list[ZipCCLRow], figure: Any, axes: Any) -> None:
    groups = [f"{r.model.split('-')[0]} {r.gpus}/{r.testbed.split(',')[0][-5:]}" for r in rows]
    series = ["modelled", "paper"]
    e2e = [[r.e2e_speedup, r.paper_e2e] for r in rows]
    comm = [[r.comm_speedup, r.paper_comm] for r in rows]
    title = "end-to-end speedup with ZipCCL: modelled vs paper"
    grouped_bars(axes[0, 0], groups, series, e2e, title=title, ylabel="speedup (x)")
    title = "communication speedup with ZipCCL: modelled vs paper"
    grouped_bars(
        axes[1, 0],
        groups,
        series,
        comm,
        title=title,
        ylabel="speedup (x)",
        xlabel="model, GPUs / testbed",
    )
