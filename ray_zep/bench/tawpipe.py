"""`ray-zep bench tawpipe`: the weight-passing strategies on TawPipe's testbed, simulated.

For LLaMA-2-style models of 48 blocks (H = 1024-4096, S = 4k-16k) on 3 nodes x
8 GPUs with 10 GbE between nodes, the simulator plays the executor's step
(`ray_zep.sim.weight_passing`) for tawpipe, ring_relay and fsdp with as many
sequences per GPU as fit in memory, and WeiPipe's staggered schedule, the
paper's baseline, which ray_zep does not execute (`ray_zep.sim.weipipe_schedule`),
with the paper's 1536 sequences per iteration cut into the micro-batches that run
fastest among those that fit. Each row gives tokens/GPU/s, the share of the step
the GPU waits (bubble), the bytes per step on each link kind and the elements
sent per GPU per layer (in H^2), next to the paper's throughput (Table 1,
Table 2, the ablation's full TawPipe) and its bubble formulas. Real CPU runs
of the executor's modes come from `ray_zep_workers.bench_train` (through Ray): the bench
itself is `ray_zep_workers.bench_tawpipe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ray_zep.model_shapes import ModelShape
from ray_zep.parallel.axes import WeightsMode
from ray_zep.report.charts import grouped_bars
from ray_zep.report.figures import save_figure
from ray_zep.report.text_table import Column
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.weight_passing import (
    WEIGHT_BYTES,
    StepModel,
    Workload,
    sequences_that_fit,
    simulate_step,
    tawpipe_testbed,
)
from ray_zep.sim.weipipe_schedule import fastest_weipipe, micro_batch_that_fits

MODES = (WeightsMode.TAWPIPE, WeightsMode.RING_RELAY, WeightsMode.FSDP)
"""The executor's weight-passing modes and its FSDP comparison (simulated and run)."""
TAW, RELAY, FSDP = (m.value for m in MODES)
WEI = "weipipe"
"""The column of WeiPipe's staggered schedule, the paper's baseline (simulated only)."""
SCHEDULES = (TAW, WEI, RELAY, FSDP)
"""Every row's `mode`, in the order of the table and the chart."""
PAPER_TOKENS: dict[tuple[int, int], dict[str, float]] = {
    (1024, 4096): {TAW: 13629, WEI: 12055, FSDP: 10559, "1f1b": 7212},
    (1024, 8192): {TAW: 11738, WEI: 10663, FSDP: 8826, "1f1b": 6636},
    (1024, 16384): {TAW: 8914, WEI: 8412, FSDP: 6751, "1f1b": 5594},
    (2048, 16384): {TAW: 4180},
    (4096, 16384): {TAW: 1377.6, WEI: 1232.4, FSDP: 956.1, "1f1b": 1114.2},
}
"""TawPipe paper, tokens/GPU/s on 24 GPUs (Tables 1-2; H=2048: the ablation's full TawPipe)."""
PAPER_GLOBAL_BATCH = 1536
"""Sequences per iteration in the paper; N below is its micro-batches per GPU."""
GOAL = (4096, 16384, 1.1)
"""Simulated tawpipe over the WeiPipe model on the paper's 24-GPU headline case (the
paper: 1.12x)."""


def llama_shape(hidden: int, layers: int = 48) -> ModelShape:
    """LLaMA-2 proportions: 128-dim heads, SwiGLU width 8H/3 rounded up to 256, 32k vocab."""
    ffn = -(-(8 * hidden // 3) // 256) * 256
    heads = hidden // 128
    return ModelShape(32000, hidden, layers, heads, heads, ffn)


@dataclass(frozen=True)
class TawPipeBenchSpec:
    hidden: tuple[int, ...] = (1024, 2048, 4096)
    seq_lens: tuple[int, ...] = (4096, 8192, 16384)
    layers: int = 48
    nic_gbps: float = 10.0
    """Line rate between nodes, Gb/s per node (90% of it is achieved)."""
    recompute: bool = True

    def cluster(self) -> Hardware:
        return tawpipe_testbed().with_links(nic_gbits_per_s=0.9 * self.nic_gbps)


@dataclass(frozen=True)
class TawPipeRow:
    """One weights mode (or the WeiPipe model) on one (H, S) case, simulated.

    Attributes:
        mode: a `SCHEDULES` name.
        sequences: per GPU per step: as many as fit, at most the paper's 64, for the
            executor's modes; the paper's 1536 / 24 GPUs for WeiPipe.
        micro_batch: sequences per micro-batch (the executor computes a step's
            sequences together; WeiPipe's fastest that fits).
        bubble: share of the step the GPU waits for weights or gradients (WeiPipe: or
            for its pipeline to fill and drain).
        nic_gb: GB per step through one node's NIC (sent), mean over nodes.
        intra_gb: GB per step over one GPU's intra-node link (sent), mean over GPUs.
        per_layer_h2: elements sent per GPU per layer per step, in units of H^2.
        paper_bubble: the paper's formula for the mode (`paper_bubble`; None: no formula).
    """

    hidden: int
    seq_len: int
    mode: str
    sequences: int
    micro_batch: int
    tokens_per_gpu_s: float
    bubble: float
    nic_gb: float
    intra_gb: float
    per_layer_h2: float
    paper_tokens: float | None
    paper_bubble: float | None


def paper_bubble(column: str, devices: int, groups: int, micro_batches: float) -> float | None:
    """The paper's bubble ratio of a column ("Theoretical Analysis"), None if it gives none.

    Args:
        micro_batches: N: TawPipe's micro-batches per GPU; for WeiPipe, those of all
            GPUs (G P), with which the paper's (P - 1) / (N + P - 1) is the bubble of
            WeiPipe's schedule (`ray_zep.sim.weipipe_schedule.weipipe_bubble`).
    """
    p, d, n = devices, groups, micro_batches
    if column == TAW:
        return ((d - 1) * p + n) / ((3 * n + d - 1) * p + n)
    if column == WEI:
        return (p - 1) / (n + p - 1)
    return None


def _row(
    spec: TawPipeBenchSpec, case: tuple[int, int], column: str, step: StepModel, micro: int
) -> TawPipeRow:
    """A row of `step`, which trains `micro` sequences per micro-batch."""
    cluster, (hidden, seq_len) = spec.cluster(), case
    sequences = round(step.tokens / seq_len)
    elements = (step.inter_bytes + step.intra_bytes) / WEIGHT_BYTES
    # N of the paper's formulas: TawPipe's micro-batches per GPU, WeiPipe's over all GPUs
    n = PAPER_GLOBAL_BATCH / (cluster.devices * sequences)
    if column == WEI:
        n = sequences // micro * cluster.devices
    return TawPipeRow(
        hidden, seq_len, column, sequences, micro, step.tokens_per_gpu_s, step.bubble,
        step.inter_bytes / cluster.nodes / 1e9, step.intra_bytes / cluster.devices / 1e9,
        elements / cluster.devices / spec.layers / hidden**2,
        PAPER_TOKENS.get(case, {}).get(column),
        paper_bubble(column, cluster.devices, cluster.nodes, n),
    )  # fmt: skip


def case_rows(spec: TawPipeBenchSpec, hidden: int, seq_len: int) -> list[TawPipeRow]:
    """The `SCHEDULES` that fit in memory on one case."""
    cluster, case = spec.cluster(), (hidden, seq_len)
    shape = llama_shape(hidden, spec.layers)
    rows: dict[str, TawPipeRow] = {}
    sequences = sequences_that_fit(shape, seq_len, cluster, spec.recompute)
    if sequences:
        work = Workload(shape, (seq_len,) * sequences, recompute=spec.recompute)
        for mode in MODES:
            rows[mode.value] = _row(
                spec, case, mode.value, simulate_step(mode, work, cluster), sequences
            )
    per_gpu = PAPER_GLOBAL_BATCH // cluster.devices
    most = micro_batch_that_fits(shape, seq_len, cluster, spec.recompute, per_gpu)
    work = Workload(shape, (seq_len,) * per_gpu, recompute=spec.recompute)
    fastest = fastest_weipipe(work, cluster, most) if most else None
    if fastest is not None:
        batches, step = fastest
        rows[WEI] = _row(spec, case, WEI, step, per_gpu // batches)
    return [rows[name] for name in SCHEDULES if name in rows]


def simulate_rows(spec: TawPipeBenchSpec) -> list[TawPipeRow]:
    return [
        row
        for hidden in spec.hidden
        for seq_len in spec.seq_lens
        for row in case_rows(spec, hidden, seq_len)
    ]


def ratio(rows: list[TawPipeRow], hidden: int, seq_len: int, over: str = WEI) -> float:
    """Simulated tawpipe tokens/GPU/s over those of column `over` (nan: either is missing)."""
    pick = {r.mode: r.tokens_per_gpu_s for r in rows if (r.hidden, r.seq_len) == (hidden, seq_len)}
    return pick[TAW] / pick[over] if TAW in pick and over in pick else float("nan")


def goals(rows: list[TawPipeRow]) -> list[tuple[str, bool]]:
    hidden, seq_len, target = GOAL
    if not any((r.hidden, r.seq_len) == (hidden, seq_len) for r in rows):
        return []
    got = ratio(rows, hidden, seq_len)
    text = f"tawpipe / weipipe at H={hidden} S={seq_len} on 24 GPUs: {got:.2f}x >= {target}x"
    return [(text, bool(got >= target))]


COLUMNS = (
    Column("H", "hidden"),
    Column("S", "seq_len"),
    Column("weights", "mode"),
    Column("seqs", "sequences"),
    Column("mb", "micro_batch"),
    Column("tok/GPU/s", "tokens_per_gpu_s", ".0f"),
    Column("bubble", "bubble", ".2f"),
    Column("NIC GB", "nic_gb", ".2f"),
    Column("intra GB", "intra_gb", ".2f"),
    Column("xH^2", "per_layer_h2", ".1f"),
    Column("paper tok", lambda r: r.paper_tokens or None, ".0f"),
    Column("paper bub", "paper_bubble", ".2f"),
)


def footer(rows: list[TawPipeRow]) -> list[str]:
    """The lines under the table: what its columns mean, then per case tawpipe over each
    other schedule, next to the paper's ratios."""
    lines = [
        f"seqs: sequences per GPU per step; mb: per micro-batch. {WEI}: WeiPipe's staggered "
        f"schedule (the paper's baseline, simulated only); {RELAY}: the executor's lockstep ring"
    ]
    for hidden, seq_len in dict.fromkeys((r.hidden, r.seq_len) for r in rows):
        paper = PAPER_TOKENS.get((hidden, seq_len), {})
        over = [(name, ratio(rows, hidden, seq_len, name)) for name in (WEI, RELAY, FSDP)]
        line = f"H={hidden} S={seq_len}: " + ", ".join(f"tawpipe/{n} {x:.2f}x" for n, x in over)
        if WEI in paper:
            line += f" (paper {paper[TAW] / paper[WEI]:.2f}x, -, {paper[TAW] / paper[FSDP]:.2f}x)"
        lines.append(line)
    return lines


def draw_tawpipe_chart(rows: list[TawPipeRow], path: Path) -> Path | None:
    """Simulated tokens/GPU/s per case, one bar per column (weights mode or WeiPipe).

    Returns:
        `path`, or None when matplotlib is not installed (the picture is skipped).
    """
    return save_figure(path, partial(_draw_tawpipe, rows), size=(12.0, 4.4))


def _draw_tawpipe(rows: list[TawPipeRow], figure: Any, axes: Any) -> None:
    cases = list(dict.fromkeys((r.hidden, r.seq_len) for r in rows))
    table = {(r.hidden, r.seq_len, r.mode): r.tokens_per_gpu_s for r in rows}
    names = list(SCHEDULES)
    values = [[table.get((h, s, name)) for name in names] for h, s in cases]
    groups = [f"H{h // 1024}k S{s // 1024}k" for h, s in cases]
    title = "simulated throughput, 3 x 8 GPUs, 10 GbE"
    grouped_bars(
        axes[0, 0],
        groups,
        names,
        values,
        title=title,
        ylabel="tokens per GPU per s",
        xlabel="model dim H and sequence length S",
    )
