"""`ray-zep bench tawpipe`: the weight-passing strategies on TawPipe's testbed, simulated.

For LLaMA-2-style models of 48 blocks (H = 1024-4096, S = 4k-16k) on 3 nodes x
8 GPUs with 10 GbE between nodes, the simulator (`ray_zep.sim.weight_passing`)
plays the executor's step for tawpipe, weipipe and fsdp with as many sequences
per GPU as fit in memory. Each row gives tokens/GPU/s, the share of the step
the GPU waits (bubble), the bytes per step on each link kind and the elements
sent per GPU per layer (in H^2), next to the paper's throughput (Table 1,
Table 2, the ablation's full TawPipe) and its bubble formulas. Real CPU runs
of the same strategies come from `workers.bench_train` (through Ray).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ray_zep.model.shapes import ModelShape
from ray_zep.parallel.axes import WeightsMode
from ray_zep.report.charts import grouped_bars
from ray_zep.report.figures import save_figure
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.weight_passing import (
    WEIGHT_BYTES,
    Workload,
    sequences_that_fit,
    simulate_step,
    tawpipe_testbed,
)

MODES = (WeightsMode.TAWPIPE, WeightsMode.WEIPIPE, WeightsMode.FSDP)
TAW, WEI, FSDP = (m.value for m in MODES)
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
"""Simulated tawpipe over weipipe on the paper's 24-GPU headline case (the paper: 1.12x)."""


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
    """One weights mode on one (H, S) case, simulated.

    Attributes:
        sequences: per GPU per step (as many as fit, at most the paper's 64).
        bubble: share of the step the GPU waits for weights or gradients.
        nic_gb: GB per step through one node's NIC (sent), mean over nodes.
        intra_gb: GB per step over one GPU's intra-node link (sent), mean over GPUs.
        per_layer_h2: elements sent per GPU per layer per step, in units of H^2.
        paper_bubble: the paper's formula for the mode at N = its micro-batches
            per GPU (None: no formula).
    """

    hidden: int
    seq_len: int
    mode: str
    sequences: int
    tokens_per_gpu_s: float
    bubble: float
    nic_gb: float
    intra_gb: float
    per_layer_h2: float
    paper_tokens: float | None
    paper_bubble: float | None


def paper_bubble(mode: WeightsMode, devices: int, groups: int, micro_batches: float):
    """The paper's bubble ratio of a mode (TawPipe; WeiPipe and 1F1B share theirs)."""
    p, d, n = devices, groups, micro_batches
    if mode is WeightsMode.TAWPIPE:
        return ((d - 1) * p + n) / ((3 * n + d - 1) * p + n)
    if mode is WeightsMode.WEIPIPE:
        return (p - 1) / (n + p - 1)
    return None


def simulate_rows(spec: TawPipeBenchSpec) -> list[TawPipeRow]:
    cluster = spec.cluster()
    rows = []
    for hidden in spec.hidden:
        shape = llama_shape(hidden, spec.layers)
        for seq_len in spec.seq_lens:
            sequences = sequences_that_fit(shape, seq_len, cluster, spec.recompute)
            paper = PAPER_TOKENS.get((hidden, seq_len), {})
            for mode in MODES:
                if sequences == 0:
                    continue
                work = Workload(shape, (seq_len,) * sequences, recompute=spec.recompute)
                step = simulate_step(mode, work, cluster)
                elements = (step.inter_bytes + step.intra_bytes) / WEIGHT_BYTES
                micro = PAPER_GLOBAL_BATCH / (cluster.devices * sequences)
                rows.append(
                    TawPipeRow(
                        hidden, seq_len, mode.value, sequences, step.tokens_per_gpu_s,
                        step.bubble, step.inter_bytes / cluster.nodes / 1e9,
                        step.intra_bytes / cluster.devices / 1e9,
                        elements / cluster.devices / spec.layers / hidden**2,
                        paper.get(mode.value),
                        paper_bubble(mode, cluster.devices, cluster.nodes, micro),
                    )
                )  # fmt: skip
    return rows


def ratio(rows: list[TawPipeRow], hidden: int, seq_len: int, over: str = WEI) -> float:
    """Simulated tawpipe tokens/GPU/s over those of mode `over`."""
    pick = {r.mode: r.tokens_per_gpu_s for r in rows if (r.hidden, r.seq_len) == (hidden, seq_len)}
    return pick[TAW] / pick[over]


def goals(rows: list[TawPipeRow]) -> list[tuple[str, bool]]:
    hidden, seq_len, target = GOAL
    if not any((r.hidden, r.seq_len) == (hidden, seq_len) for r in rows):
        return []
    got = ratio(rows, hidden, seq_len)
    text = f"tawpipe / weipipe at H={hidden} S={seq_len} on 24 GPUs: {got:.2f}x >= {target}x"
    return [(text, got >= target)]


def format_table(rows: list[TawPipeRow]) -> str:
    header = f"{'H':>5} {'S':>6} {'weights':<8} {'seqs':>4} {'tok/GPU/s':>10} {'bubble':>6} "
    header += f"{'NIC GB':>7} {'intra GB':>8} {'xH^2':>5} {'paper tok':>9} {'paper bub':>9}"
    lines = [header, "-" * len(header)]
    for r in rows:
        paper = f"{r.paper_tokens:>9.0f}" if r.paper_tokens else f"{'-':>9}"
        bubble = f"{r.paper_bubble:>9.2f}" if r.paper_bubble is not None else f"{'-':>9}"
        lines.append(
            f"{r.hidden:>5} {r.seq_len:>6} {r.mode:<8} {r.sequences:>4} "
            f"{r.tokens_per_gpu_s:>10.0f} {r.bubble:>6.2f} {r.nic_gb:>7.2f} {r.intra_gb:>8.2f} "
            f"{r.per_layer_h2:>5.1f} {paper} {bubble}"
        )
    cases = list(dict.fromkeys((r.hidden, r.seq_len) for r in rows))
    for hidden, seq_len in cases:
        paper = PAPER_TOKENS.get((hidden, seq_len), {})
        line = f"H={hidden} S={seq_len}: tawpipe/weipipe {ratio(rows, hidden, seq_len):.2f}x, "
        line += f"tawpipe/fsdp {ratio(rows, hidden, seq_len, FSDP):.2f}x"
        if WEI in paper:
            line += f" (paper {paper[TAW] / paper[WEI]:.2f}x, {paper[TAW] / paper[FSDP]:.2f}x)"
        lines.append(line)
    return "\n".join(lines)


def row_dicts(rows: list[TawPipeRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def draw_tawpipe_chart(rows: list[TawPipeRow], path: Path) -> Path | None:
    """Simulated tokens/GPU/s per case, one bar per weights mode.

    Returns:
        `path`, or None when matplotlib is not installed (the picture is skipped).
    """
    return save_figure(path, partial(_draw_tawpipe, rows), size=(12.0, 4.4))


def _draw_tawpipe(rows: list[TawPipeRow], figure: Any, axes: Any) -> None:
    cases = list(dict.fromkeys((r.hidden, r.seq_len) for r in rows))
    table = {(r.hidden, r.seq_len, r.mode): r.tokens_per_gpu_s for r in rows}
    names = [m.value for m in MODES]
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
