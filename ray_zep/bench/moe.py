"""`ray-zep bench moe`: MoE block latency under each FoldMoE schedule.

Two parts, printed side by side:

- simulated: per-block forward + backward latency of GPT-MoE-S/M/L at 4k-32k
  on the FoldMoE testbed model (`ray_zep.sim.moe_block`), each schedule at its
  best overlap degree; a second table puts the latencies the paper reports
  (Table 2: Megatron-MoE, Tutel at its best d, FoldMoE at its best d) beside
  our speedup on each case;
- measured: the real pipelined block (`ray_zep.moe.pipeline`) on this machine,
  one gloo process per virtual GPU with the experts spread over all of them.
"""

from __future__ import annotations

import argparse
import datetime
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ray_zep.bench.local_ranks import rank_context, start_ranks
from ray_zep.command_args import counts, names, positive
from ray_zep.config import MoEPipeline
from ray_zep.distributed.launch import free_port
from ray_zep.model_shapes import PRESETS, ModelShape
from ray_zep.report.charts import grouped_bars
from ray_zep.report.figures import save_figure
from ray_zep.report.output import BenchResult
from ray_zep.report.text_table import Column, render_table
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.moe_block import block_seconds, foldmoe_testbed

SCHEDULES: dict[str, tuple[MoEPipeline, bool]] = {
    "none": (MoEPipeline.NONE, False),
    "moe_only": (MoEPipeline.MOE_ONLY, False),
    "aaam": (MoEPipeline.AAAM, False),
    "1a1m": (MoEPipeline.ONE_A_ONE_M, False),
    "1a1m+uniform": (MoEPipeline.ONE_A_ONE_M, True),
}
PAPER_BLOCK_MS: dict[tuple[str, int], tuple[float, float, float]] = {
    ("gpt_moe_s", 4096): (272.36, 289.46, 272.95),
    ("gpt_moe_s", 8192): (613.19, 458.18, 403.56),
    ("gpt_moe_s", 16384): (1885.48, 939.75, 788.57),
    ("gpt_moe_s", 32768): (2499.82, 1930.80, 1759.33),
    ("gpt_moe_m", 4096): (361.86, 427.28, 322.06),
    ("gpt_moe_m", 8192): (935.77, 569.65, 572.44),
    ("gpt_moe_m", 16384): (2749.70, 1774.98, 1189.83),
    ("gpt_moe_m", 32768): (5787.19, 2483.79, 2130.07),
    ("gpt_moe_l", 4096): (800.94, 431.37, 400.10),
    ("gpt_moe_l", 8192): (1688.37, 746.55, 738.90),
    ("gpt_moe_l", 16384): (2839.86, 1730.58, 1309.26),
    ("gpt_moe_l", 32768): (4382.43, 3620.50, 2724.75),
}
"""FoldMoE Table 2, ms per block: (Megatron-MoE, Tutel best d, FoldMoE best d)."""
GOAL = ("gpt_moe_m", 16384, 1.3)
"""Simulated 1a1m+uniform over moe_only on GPT-MoE-M at 16k (the paper: 1.49x)."""
NAME = "moe"
HELP = "MoE block latency per FoldMoE schedule"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="gpt_moe_s,gpt_moe_m,gpt_moe_l", help="MoE presets")
    parser.add_argument("--seq-lens", default="4k,8k,16k,32k", help="sequence lengths")
    parser.add_argument("--degrees", default="2,4,8,16", help="overlap degrees to search")
    parser.add_argument(
        "--cpu-ranks", type=int, default=4, help="processes of the real runs (0: none)"
    )
    parser.add_argument("--cpu-tokens", type=int, default=2048, help="tokens per process")
    parser.add_argument("--cpu-degree", type=int, default=4, help="overlap degree of the real runs")
    parser.add_argument(
        "--nic-gbps", type=float, default=40.0, help="achieved Gb/s between nodes (default 40)"
    )
    parser.add_argument(
        "--intra-gbytes", type=float, default=5.0, help="achieved GB/s per GPU in a node (5)"
    )


def run(args: argparse.Namespace) -> BenchResult:
    positive("--nic-gbps", args.nic_gbps)
    positive("--intra-gbytes", args.intra_gbytes)
    spec = MoEBenchSpec(
        models=names(args.models, ()),
        seq_lens=counts(args.seq_lens, "--seq-lens"),
        degrees=counts(args.degrees, "--degrees"),
        cpu_ranks=args.cpu_ranks,
        cpu_tokens=args.cpu_tokens,
        cpu_degree=args.cpu_degree,
        nic_gbps=args.nic_gbps,
        intra_gbytes=args.intra_gbytes,
    )
    rows = simulate_rows(spec)
    if spec.cpu_ranks > 1:
        rows += measure_rows(spec)
    return BenchResult.from_rows(
        NAME,
        asdict(spec),
        rows,
        COLUMNS,
        draw_moe_chart,
        records=row_dicts(rows),
        footer=paper_footer(rows),
        goals=goals(rows),
    )


@dataclass(frozen=True)
class MoEBenchSpec:
    models: tuple[str, ...] = ("gpt_moe_s", "gpt_moe_m", "gpt_moe_l")
    seq_lens: tuple[int, ...] = (4096, 8192, 16384, 32768)
    degrees: tuple[int, ...] = (2, 4, 8, 16)
    cpu_ranks: int = 4
    cpu_tokens: int = 2048
    cpu_degree: int = 4
    repeats: int = 3
    nic_gbps: float = 40.0
    """Achieved inter-node bandwidth of one node (its one NIC), Gb/s each way (the
    `foldmoe_a10g` topology preset's assumption)."""
    intra_gbytes: float = 5.0
    """Achieved intra-node bandwidth of one GPU, GB/s each way (the preset's assumption)."""

    def cluster(self) -> Hardware:
        """The testbed with this spec's bandwidths."""
        return foldmoe_testbed().with_links(self.nic_gbps, self.intra_gbytes)


@dataclass(frozen=True)
class MoERow:
    """One schedule on one case: simulated (ms, at its best d) or measured here."""

    source: str
    model: str
    seq_len: int
    schedule: str
    degree: int
    forward_ms: float
    backward_ms: float

    @property
    def total_ms(self) -> float:
        return self.forward_ms + self.backward_ms


def simulate_rows(spec: MoEBenchSpec) -> list[MoERow]:
    cluster = spec.cluster()
    rows = []
    for model in spec.models:
        for seq_len in spec.seq_lens:
            for name, (schedule, uniform) in SCHEDULES.items():
                degrees = (1,) if schedule is MoEPipeline.NONE else spec.degrees
                timed = [
                    (block_seconds(PRESETS[model], seq_len, schedule, d, uniform, cluster), d)
                    for d in degrees
                ]
                (fwd, bwd), d = min(timed, key=lambda t: sum(t[0]))
                rows.append(MoERow("simulated", model, seq_len, name, d, fwd * 1e3, bwd * 1e3))
    return rows


def speedup(rows: list[MoERow], model: str, seq_len: int, over: str = "moe_only") -> float:
    """Total latency of `over` divided by 1a1m+uniform's, on one case."""
    pick = {r.schedule: r.total_ms for r in rows if (r.model, r.seq_len) == (model, seq_len)}
    return pick[over] / pick["1a1m+uniform"]


def goals(rows: list[MoERow]) -> list[tuple[str, bool]]:
    """The speedup goal, where the rows simulate its case."""
    model, seq_len, target = GOAL
    if (model, seq_len) not in {(r.model, r.seq_len) for r in rows}:
        return []
    got = speedup(rows, model, seq_len)
    return [
        (f"1a1m+uniform / moe_only on {model} {seq_len}: {got:.2f}x >= {target}x", got >= target)
    ]


COLUMNS = (
    Column("source", "source"),
    Column("model", "model"),
    Column("seq", "seq_len"),
    Column("schedule", "schedule"),
    Column("d", "degree"),
    Column("fwd ms", "forward_ms", ".3f"),
    Column("bwd ms", "backward_ms", ".3f"),
    Column("total ms", "total_ms", ".3f"),
)
PAPER_COLUMNS = (
    Column("paper case", lambda r: f"{r['model']} {r['seq_len']}"),
    Column("Megatron ms", "megatron_ms", ".0f"),
    Column("Tutel ms", "tutel_ms", ".0f"),
    Column("FoldMoE ms", "foldmoe_ms", ".0f"),
    Column("paper Tutel/FoldMoE", "paper_speedup", ".2f"),
    Column("ours moe_only/1a1m+uniform", "our_speedup", ".2f"),
)


def paper_rows(rows: list[MoERow]) -> list[dict[str, Any]]:
    """Each simulated case of FoldMoE's Table 2: the paper's ms next to our speedup."""
    cases = dict.fromkeys((r.model, r.seq_len) for r in rows if r.source == "simulated")
    out = []
    for model, seq_len in cases:
        paper = PAPER_BLOCK_MS.get((model, seq_len))
        if paper is None:
            continue
        megatron, tutel, foldmoe = paper
        out.append(
            {"model": model, "seq_len": seq_len, "megatron_ms": megatron, "tutel_ms": tutel,
             "foldmoe_ms": foldmoe, "paper_speedup": tutel / foldmoe,
             "our_speedup": speedup(rows, model, seq_len)}
        )  # fmt: skip
    return out


def paper_footer(rows: list[MoERow]) -> list[str]:
    """The paper's latencies (FoldMoE Table 2, best d) beside our simulated speedup."""
    paper = paper_rows(rows)
    return ["", render_table(paper, PAPER_COLUMNS)] if paper else []


def row_dicts(rows: list[MoERow]) -> list[dict]:
    return [{**asdict(r), "total_ms": r.total_ms} for r in rows]


def draw_moe_chart(rows: list[MoERow], path: Path) -> Path | None:
    """Total block latency per case, one bar per schedule (simulated).

    Returns:
        `path`, or None when matplotlib is not installed (the picture is skipped).
    """
    return save_figure(path, partial(_draw_moe, rows), size=(12.0, 4.4))


def _draw_moe(rows: list[MoERow], figure: Any, axes: Any) -> None:
    cases = list(dict.fromkeys((r.model, r.seq_len) for r in rows if r.source == "simulated"))
    table = {(r.model, r.seq_len, r.schedule): r.total_ms for r in rows}
    values = [[table.get((m, s, name)) for name in SCHEDULES] for m, s in cases]
    groups = [f"{m[-1].upper()}{s // 1024}k" for m, s in cases]
    title = "simulated MoE block latency (forward + backward)"
    grouped_bars(
        axes[0, 0],
        groups,
        list(SCHEDULES),
        values,
        title=title,
        ylabel="ms per MoE block",
        xlabel="model (S/M/L) and sequence length",
    )


def measure_rows(spec: MoEBenchSpec) -> list[MoERow]:
    """The real block on `cpu_ranks` gloo processes, every schedule (best of `repeats`)."""
    port = free_port()
    queue = rank_context().SimpleQueue()
    start_ranks(_measure_rank, (spec, port, queue), spec.cpu_ranks)
    return queue.get()


def cpu_shape(ranks: int) -> ModelShape:
    """A small GPT-MoE-like block with one expert per process."""
    return ModelShape(
        vocab_size=256, dim=128, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=512,
        moe_experts=ranks, moe_top_k=1, moe_capacity_factor=1.0, moe_hidden=256, moe_every=1,
    )  # fmt: skip


def _measure_rank(rank: int, spec: MoEBenchSpec, port: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=spec.cpu_ranks,
        timeout=datetime.timedelta(seconds=120),
    )
    rows = _time_schedules(spec)  # its blocks, graphs and work handles are gone on return
    if rank == 0:
        queue.put(rows)
    dist.barrier()  # no rank tears the group down while a peer still uses it
    dist.destroy_process_group()


def _time_schedules(spec: MoEBenchSpec) -> list[MoERow]:
    """This rank's part of `measure_rows` (best of `repeats` per schedule, the slowest
    rank's times)."""
    from ray_zep.attention.kernels import torch_varlen_attention
    from ray_zep.attention.rope import rope_tables
    from ray_zep.attention.varlen import PackedSeqs
    from ray_zep.distributed.group import Group
    from ray_zep.model.llama import Block
    from ray_zep.moe.layer import shard_experts
    from ray_zep.moe.pipeline import FoldedForward

    shape = cpu_shape(spec.cpu_ranks)
    block = Block(shape, 0)
    torch.manual_seed(0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    block.feed_forward.capacity_tokens = spec.cpu_tokens
    shard_experts(block.feed_forward, Group(dist.group.WORLD, 120.0))
    seqs = PackedSeqs.from_lengths([spec.cpu_tokens])
    rope = rope_tables(torch.from_numpy(seqs.positions()), shape.head_dim, shape.rope_theta)
    x = torch.randn(spec.cpu_tokens, shape.dim)
    rows = []
    for name, (schedule, uniform) in SCHEDULES.items():
        degree = 1 if schedule is MoEPipeline.NONE else spec.cpu_degree
        block.pipeline = (
            None if schedule is MoEPipeline.NONE else FoldedForward(schedule, degree, uniform)
        )
        best = (float("inf"), float("inf"))
        for _ in range(spec.repeats + 1):  # the first run warms up
            dist.barrier()
            start = time.perf_counter()
            inp = x.clone().requires_grad_(True)
            out = block(inp, rope, seqs, torch_varlen_attention)
            mid = time.perf_counter()
            out.sum().backward()
            end = time.perf_counter()
            times = torch.tensor([mid - start, end - mid])
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            best = min(best, (float(times[0]), float(times[1])), key=sum)
        rows.append(
            MoERow("cpu", f"cpu x{spec.cpu_ranks}", spec.cpu_tokens, name, degree,
                   best[0] * 1e3, best[1] * 1e3)
        )  # fmt: skip
    return rows
