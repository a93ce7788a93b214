"""The papers' headline figures, simulated on their own setups.

Each row is one figure a paper reports for its method against a baseline, next to
what the simulator gives on that setup (the setups and their sources are those
of `ray-zep simulate`, `bench tawpipe`, `bench moe` and `bench zipccl`):

- Zeppelin (its §5, cluster A): the mean speedup over TE CP of the 7B model on
  the three datasets at 16, 32 and 64 GPUs with 4k tokens per GPU (Fig. 8 covers
  these among others); Fig. 11's ablation on the 3B model, 32 GPUs, arxiv;
  Fig. 12's TE CP round on the 3B model, 16 GPUs, one 64k sequence.
- TawPipe (its throughput tables, 24 GPUs, 10 GbE): over WeiPipe at H=1024,
  S=4k (the simulator's model of WeiPipe's staggered schedule,
  `ray_zep.sim.weipipe_schedule`) and over FSDP at H=4096, S=16k.
- FoldMoE (its Table 2): 1a1m with time-uniform slices over MoE-only overlap
  (Tutel) on GPT-MoE-M at 16k, at the testbed's assumed 40 Gb/s achieved and
  at the 100 Gb/s line rate the paper states.
- ZipCCL (its §6.2): end to end on Llama3-8B with FSDP, 64 RTX A6000.

A row whose simulated figure is more than `TOLERANCE` away from the paper's says
why in `explained` (the modelling choice behind the gap, as BENCHMARKS.md
reports it); None where the figure is within it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

import numpy as np

from ray_zep.config import Config, load_config
from ray_zep.model_shapes import PRESETS
from ray_zep.partition import make_plan, registry
from ray_zep.partition.spec import Role
from ray_zep.sim.compare import ABLATION, REFERENCE, ROUTED_PARTITION, ROUTED_TE_CP
from ray_zep.sim.events import Lane
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.request import SimulateRequest, run_simulate
from ray_zep.sim.step import RunModel, simulate_plan
from ray_zep.topology import build_topology

TOLERANCE = 0.25
"""Relative distance from the paper's figure within which no explanation is owed."""
FIG8_DATASETS = ("arxiv", "github", "prolong64k")
FIG8_NODES = (2, 4, 8)
TOKENS_PER_GPU = 4096


@dataclass(frozen=True)
class PaperRow:
    """One headline: the paper's figure and the simulated one on the same setup."""

    name: str
    paper: float
    simulated: float
    explained: str | None = None

    @property
    def within(self) -> bool:
        return abs(self.simulated / self.paper - 1.0) <= TOLERANCE

    def to_dict(self) -> dict:
        return {"kind": "paper", **asdict(self)}


_NO_SM_STALL = (
    "routed pieces and the intra-node rings' transfers run at link speed beside attention: "
    "the paper's Fig. 12b shows inter-node kernels stalling behind attention kernels for "
    "SMs (its routed round takes 411 us, not 2.18 ms / 4, and forward communication "
    "falls only to 1.3 ms), which the simulator models only as compute slowed by 1.19 "
    "(arXiv 2507.03114) while transfers are not slowed by compute"
)
EXPLANATIONS: dict[str, str] = {
    "zeppelin/fig8_7b_mean_speedup_over_te_cp": _NO_SM_STALL,
    "zeppelin/fig11_arxiv_routing_over_te_cp": _NO_SM_STALL,
    "zeppelin/fig11_arxiv_engine_over_te_cp": _NO_SM_STALL,
    "zeppelin/fig11_arxiv_zeppelin_over_te_cp": _NO_SM_STALL,
    "tawpipe/h1024_s4k_over_weipipe": (
        "the tawpipe figure is our executor, which runs every shard over all {taw_seqs} "
        "sequences of its step at once and so waits only where a transfer shows "
        "({taw_bubble:.0%} of the step): {taw:.0f} tokens/GPU/s, {taw_gain:.2f}x the paper's "
        "TawPipe ({paper_taw:.0f}), whose micro-batch pipeline its own bubble formula puts at "
        "{paper_taw_bubble:.0%}; the WeiPipe model (Gvilenius/weipipe weipipe.py, "
        "forward_backward_step, on the same cluster) pipelines the paper's {wei_seqs} "
        "sequences per GPU as micro-batches of {wei_mb}, the fastest split that fits, and "
        "fills and drains its ring for {wei_bubble:.0%} of the step: {wei:.0f}, "
        "{wei_gain:.2f}x the paper's WeiPipe ({paper_wei:.0f}); the gap comes from the "
        "pipeline bubble the executor does not have, not from the transports"
    ),
    "tawpipe/h4096_s16k_over_fsdp": (
        "the FSDP-style baseline is one pipelined broadcast and reduce per shard, prefetched; "
        "both it and TawPipe put one shard per NIC direction on the critical path, so "
        "TawPipe's third fewer NIC bytes do not shorten the step on a full-duplex 10 GbE "
        "link; the paper's FSDP (ZeRO-3) runs slower than that model"
    ),
    "foldmoe/gpt_moe_m_16k_over_moe_only_100gbps_line_rate": (
        "at the stated 100 Gb/s line rate the all-to-alls take less than the attention that "
        "hides them, so the overlap has little left to win; the paper does not state its "
        "achieved bandwidth (g5 has no EFA); at the assumed 40 Gb/s achieved the model "
        "gives the next row"
    ),
}
"""Why a simulated headline differs from the paper's by more than `TOLERANCE`."""


def _row(name: str, paper: float, simulated: float) -> PaperRow:
    row = PaperRow(name, paper, simulated)
    if row.within:
        return row
    return PaperRow(name, paper, simulated, EXPLANATIONS.get(name, "no explanation recorded"))


def _cluster_a(nodes: int, model: str) -> Config:
    return load_config(
        None, ["topology.preset=cluster_a", f"topology.nodes={nodes}", f"model.preset={model}"]
    )


def _speedups(config: Config, dataset: str, strategies: str, batches: int) -> dict[str, float]:
    gpus = config.topology.nodes * 8
    request = SimulateRequest(strategies, False, batches, dataset, gpus * TOKENS_PER_GPU)
    results = run_simulate(config, request).results
    return {name: r.speedup_vs_te_cp or float("nan") for name, r in results.items()}


def zeppelin_rows(batches: int) -> list[PaperRow]:
    ours, te_cp = registry.playing(Role.SYSTEM).name, REFERENCE
    fig8 = [
        _speedups(_cluster_a(nodes, "7b"), dataset, f"{ours},{te_cp}", batches)[ours]
        for dataset in FIG8_DATASETS
        for nodes in FIG8_NODES
    ]
    fig11 = _speedups(_cluster_a(4, "3b"), "arxiv", ",".join(ABLATION), batches)
    forward, backward = te_cp_round_seconds()
    return [
        _row("zeppelin/fig8_7b_mean_speedup_over_te_cp", 2.80, float(np.mean(fig8))),
        _row("zeppelin/fig11_arxiv_routing_over_te_cp", 1.6, fig11[ROUTED_TE_CP]),
        _row("zeppelin/fig11_arxiv_engine_over_te_cp", 3.51, fig11[ROUTED_PARTITION]),
        _row("zeppelin/fig11_arxiv_zeppelin_over_te_cp", 3.64, fig11[ours]),
        _row("zeppelin/fig12_te_cp_round_forward_ms", 2.18, forward * 1e3),
        _row("zeppelin/fig12_te_cp_round_backward_ms", 4.41, backward * 1e3),
    ]


def te_cp_round_seconds() -> tuple[float, float]:
    """Inter-node transfer time of one TE CP ring round (forward, backward) on the rank at
    the node boundary: 3B, 16 GPUs of cluster A, one 64k sequence (Fig. 12a), dK/dV in
    the activation dtype as TE sends them; a backward round moves K/V and dK/dV."""
    config = _cluster_a(2, "3b")
    topology = build_topology(config.topology)
    plan = make_plan(
        registry.reference().axis.placement, [65536], topology, TOKENS_PER_GPU, PRESETS["3b"]
    )
    run = RunModel.create(config, Hardware.preset(topology)).with_te_wire()
    step = simulate_plan(plan, run)
    rounds = topology.world_size - 1
    boundary = topology.gpus_per_node - 1
    forward, backward = (
        t.busy(boundary, Lane.INTER_NODE) / rounds for t in (step.forward, step.backward)
    )
    return forward, backward


def tawpipe_rows() -> list[PaperRow]:
    from ray_zep.bench.tawpipe import FSDP, TawPipeBenchSpec, ratio, simulate_rows

    rows = simulate_rows(TawPipeBenchSpec(hidden=(1024, 4096), seq_lens=(4096, 16384)))
    over_weipipe = _row("tawpipe/h1024_s4k_over_weipipe", 13629 / 12055, ratio(rows, 1024, 4096))
    if over_weipipe.explained is not None:
        text = over_weipipe.explained.format(**_tawpipe_figures(rows, 1024, 4096))
        over_weipipe = dataclasses.replace(over_weipipe, explained=text)
    return [
        over_weipipe,
        _row("tawpipe/h4096_s16k_over_fsdp", 1377.6 / 956.1, ratio(rows, 4096, 16384, FSDP)),
    ]


def _tawpipe_figures(rows: list, hidden: int, seq_len: int) -> dict[str, float]:
    """The simulated and paper figures the TawPipe-over-WeiPipe explanation quotes."""
    from ray_zep.bench.tawpipe import PAPER_TOKENS, TAW, WEI

    pick = {r.mode: r for r in rows if (r.hidden, r.seq_len) == (hidden, seq_len)}
    taw, wei, paper = pick[TAW], pick[WEI], PAPER_TOKENS[hidden, seq_len]
    return {
        "taw": taw.tokens_per_gpu_s,
        "taw_seqs": taw.sequences,
        "taw_bubble": taw.bubble,
        "taw_gain": taw.tokens_per_gpu_s / paper[TAW],
        "paper_taw": paper[TAW],
        "paper_taw_bubble": taw.paper_bubble or 0.0,
        "wei": wei.tokens_per_gpu_s,
        "wei_seqs": wei.sequences,
        "wei_mb": wei.micro_batch,
        "wei_bubble": wei.bubble,
        "wei_gain": wei.tokens_per_gpu_s / paper[WEI],
        "paper_wei": paper[WEI],
    }


def foldmoe_rows() -> list[PaperRow]:
    from ray_zep.bench.moe import MoEBenchSpec, simulate_rows, speedup

    out = []
    for gbps, label in ((40.0, "40gbps_achieved"), (100.0, "100gbps_line_rate")):
        spec = MoEBenchSpec(models=("gpt_moe_m",), seq_lens=(16384,), cpu_ranks=0, nic_gbps=gbps)
        simulated = speedup(simulate_rows(spec), "gpt_moe_m", 16384)
        out.append(_row(f"foldmoe/gpt_moe_m_16k_over_moe_only_{label}", 1.49, simulated))
    return out


def zipccl_rows(sample: int) -> list[PaperRow]:
    from ray_zep.bench.zipccl import SETUPS, Assumptions
    from ray_zep.bench.zipccl_report import layer_weights, measure_ratios, model_row

    ratios = measure_ratios(layer_weights(sample=sample), None)
    setup = next(s for s in SETUPS if s.model.name.startswith("Llama3") and s.gpus == 64)
    row = model_row(setup, Assumptions(), ratios)
    return [_row("zipccl/llama3_8b_fsdp_64_a6000_end_to_end", 1.18, row.e2e_speedup)]


def paper_rows(quick: bool) -> list[PaperRow]:
    """Every headline (`quick`: one sampled batch per Zeppelin setup, fewer weights sampled
    for the ZipCCL ratio)."""
    batches = 1 if quick else 3
    return [
        *zeppelin_rows(batches),
        *tawpipe_rows(),
        *foldmoe_rows(),
        *zipccl_rows(1 << 20 if quick else 1 << 24),
    ]
