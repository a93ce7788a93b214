"""`ray-zep bench zipccl`: measured ratios in, modelled rows, table, JSON and PNG out.

The ratios come from our codec (`ray_zep.collectives.compress`) on this machine:
BF16 weights of one Llama3-8B-shaped block initialised like `ray_zep.model`
does, and the demo model's BF16 hidden states and gradients after a few CPU
training steps (the tensors of `ray-zep bench codec`'s model rows).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ray_zep.bench.zipccl import LLAMA3_8B, SETUPS, Assumptions, DenseModel, Ratios, Setup
from ray_zep.bench.zipccl_model import codec_bytes_s, model_step
from ray_zep.collectives import compress
from ray_zep.errors import ConfigError
from ray_zep.model.llama import INIT_STD, Block
from ray_zep.model_shapes import ModelShape
from ray_zep.report.charts import grouped_bars
from ray_zep.report.figures import save_figure


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


def _x(value: float | None, approximate: bool = False) -> str:
    if value is None:
        return "-"
    return f"{'~' if approximate else ''}{value:.2f}x"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def format_table(rows: list[ZipCCLRow]) -> str:
    """Modelled step off/on and speedups next to the paper's (~: "around" in the paper).

    `other s`: the collectives outside the paper's communication figure, NCCL (FSDP
    reduce-scatters, MoE gradient all-reduce)."""
    head = f"{'setup (modelled)':<24} {'GPUs':>4} {'compute s':>9} {'other s':>7} "
    head += f"{'step off s':>10} "
    head += f"{'step on s':>9} {'e2e':>6} {'comm':>6} {'paper e2e':>9} {'paper comm':>10} "
    head += f"{'d e2e':>6} {'d comm':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.setup:<24} {r.gpus:>4} {r.compute_s:>9.3f} {r.other_comm_off_s:>7.3f} "
            f"{r.step_off_s:>10.3f} "
            f"{r.step_on_s:>9.3f} {_x(r.e2e_speedup):>6} {_x(r.comm_speedup):>6} "
            f"{_x(r.paper_e2e, r.paper_approximate):>9} "
            f"{_x(r.paper_comm, r.paper_approximate):>10} "
            f"{_signed(r.e2e_diff):>6} {_signed(r.comm_diff):>6}"
        )
    return "\n".join(lines)


def row_dicts(rows: list[ZipCCLRow]) -> list[dict]:
    return [asdict(r) for r in rows]


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
