"""Latency of one MoE block under a pipeline program, on a modelled cluster.

Two resources per GPU, as on the GPU: a compute stream that runs the
program's steps in order, and a communication stream that runs the posted
all-to-alls first-in first-out. A step that waits for a transfer starts when
both the compute stream and the transfer are done. Backward plays the program
in reverse (see `ray_zep.moe.schedule`) with compute costs scaled.

The setup follows the FoldMoE evaluation: attention under tensor + sequence
parallelism inside each node (each GPU computes 1/G of every slice and holds
1/G of its tokens for the MoE layer), experts spread one per GPU over all
nodes, one sequence per node. Legend: L tokens of a sequence, G GPUs per node.

Tensor + sequence parallelism gathers a slice's tokens before attention and
reduce-scatters its output after (Megatron's sequence parallelism; in backward
the other way round). Those collectives block the compute stream as they do
in Megatron, so they are part of an attention step: its computation scales
for backward, its collectives do not. They share the GPU's PCIe link with the
all-to-alls' traffic; that contention is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_zep.config import MoEPipeline
from ray_zep.model.shapes import ModelShape
from ray_zep.moe.schedule import Kind, Step, attention_slices, build_program
from ray_zep.moe.slicing import (
    micro_batch_sizes,
    slice_costs,
    time_uniform_slices,
    token_uniform_slices,
)

BACKWARD_MATMUL_FACTOR = 2.0
"""Backward FLOPs per forward FLOP of a matmul (input and weight gradients)."""
BACKWARD_ATTENTION_FACTOR = 2.5
"""Backward time per forward time of flash attention (it recomputes the scores)."""


@dataclass(frozen=True)
class Cluster:
    """What the model needs of the hardware (achieved rates, not peaks).

    Attributes:
        gpus_per_node: G, the tensor/sequence-parallel degree of attention.
        nodes: nodes; experts (EP) span G x nodes GPUs.
        matmul_flops: achieved dense matmul rate per GPU, FLOP/s.
        attention_flops: achieved attention rate per GPU, FLOP/s.
        nic_bytes_per_s: one node's inter-node bandwidth, each way, shared by its GPUs.
        intra_bytes_per_s: one GPU's intra-node bandwidth, each way.
        latency_s: fixed cost of one all-to-all.
        step_overhead_s: fixed cost of one step of a program (kernel launches,
            permutations), what makes a large d stop paying off.
        bytes_per_element: activation element size on the wire.
    """

    gpus_per_node: int
    nodes: int
    matmul_flops: float
    attention_flops: float
    nic_bytes_per_s: float
    intra_bytes_per_s: float
    latency_s: float
    step_overhead_s: float
    bytes_per_element: int = 2

    @property
    def experts_span(self) -> int:
        return self.gpus_per_node * self.nodes


A10G_100GBE = Cluster(
    gpus_per_node=8,
    nodes=2,
    matmul_flops=50e12,
    attention_flops=40e12,
    nic_bytes_per_s=0.4 * 100e9 / 8,
    intra_bytes_per_s=5e9,
    latency_s=50e-6,
    step_overhead_s=30e-6,
)
"""The FoldMoE testbed: 2 x g5.48xlarge (8 A10G each on PCIe), 100 Gb/s between nodes.
Achieved rates are assumptions, not measurements: 50 / 40 TFLOP/s for fp16
matmuls / flash attention; 40% of the 100 Gb/s line rate, since g5 has no EFA
and NCCL goes through its socket transport; 5 GB/s per GPU inside a node, as
PCIe traffic without NVLink is staged through the host."""


@dataclass
class StageTimes:
    """Forward seconds of each step's computation and each transfer."""

    attend: list[float]
    attend_collectives: list[float]
    gate: list[float]
    experts: list[float]
    combine: list[float]
    dispatch_comm: list[float]
    combine_comm: list[float]


@dataclass
class Timeline:
    """Start and end of every step and transfer of one pass."""

    compute: list[tuple[str, float, float]] = field(default_factory=list)
    comm: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def end(self) -> float:
        return max((e for _, _, e in self.compute), default=0.0)


def stage_times(
    shape: ModelShape, seq_len: int, schedule: MoEPipeline, degree: int, uniform: bool, c: Cluster
) -> StageTimes:
    """Per-GPU forward times of one MoE block of `shape` on a sequence of `seq_len`."""
    d = 1 if schedule is MoEPipeline.NONE else degree
    slices = _slices(shape, seq_len, schedule, d, uniform)
    flops = slice_costs([seq_len], slices, shape.dim, shape.n_heads, causal=True)
    attend = [f / c.gpus_per_node / c.attention_flops + c.step_overhead_s for f in flops]
    gathered = [2 * _ring_seconds(n * shape.dim * c.bytes_per_element, c) for n in slices]
    tokens = [n / c.gpus_per_node for n in micro_batch_sizes(seq_len, d)]
    k, dim = shape.moe_top_k, shape.dim
    gate = [2 * dim * shape.moe_experts * n / c.matmul_flops + c.step_overhead_s for n in tokens]
    experts = [
        2 * 3 * dim * shape.expert_hidden * k * n / c.matmul_flops + c.step_overhead_s
        for n in tokens
    ]
    comm = [_all_to_all_seconds(n * k * dim * c.bytes_per_element, c) for n in tokens]
    overhead = [c.step_overhead_s] * d
    return StageTimes(attend, gathered, gate, experts, overhead, comm, list(comm))


def _slices(shape, seq_len, schedule, d, uniform) -> list[int]:
    if attention_slices(schedule, d) == 1:
        return [seq_len]
    if uniform:
        return time_uniform_slices([seq_len], d, shape.dim, shape.n_heads)
    return token_uniform_slices(seq_len, d)


def _ring_seconds(gathered_bytes: float, c: Cluster) -> float:
    """A ring all-gather (or reduce-scatter) of `gathered_bytes` over a node's GPUs."""
    g = c.gpus_per_node
    if g == 1:
        return 0.0
    return c.latency_s + gathered_bytes * (g - 1) / g / c.intra_bytes_per_s


def _all_to_all_seconds(send_bytes: float, c: Cluster) -> float:
    """One GPU's all-to-all of `send_bytes` spread evenly over every expert's GPU."""
    span = c.experts_span
    inter = send_bytes * (span - c.gpus_per_node) / span
    intra = send_bytes * (c.gpus_per_node - 1) / span
    nic_share = c.nic_bytes_per_s / c.gpus_per_node
    return c.latency_s + max(inter / nic_share, intra / c.intra_bytes_per_s)


def play(program: list[Step], times: StageTimes, backward: bool = False) -> Timeline:
    """Run a program (or its reverse, for backward) on the two streams."""
    steps = list(reversed(program)) if backward else program
    # Forward: DISPATCH posts D, EXPERTS waits D and posts C, COMBINE waits C.
    # Backward: COMBINE posts C', EXPERTS waits C' and posts D', DISPATCH waits D'.
    posts = (
        {Kind.DISPATCH: "D", Kind.EXPERTS: "C"}
        if not backward
        else {
            Kind.COMBINE: "C",
            Kind.EXPERTS: "D",
        }
    )
    waits = (
        {Kind.EXPERTS: "D", Kind.COMBINE: "C"}
        if not backward
        else {
            Kind.EXPERTS: "C",
            Kind.DISPATCH: "D",
        }
    )
    compute_cost = {
        Kind.ATTEND: times.attend,
        Kind.DISPATCH: times.gate,
        Kind.EXPERTS: times.experts,
        Kind.COMBINE: times.combine,
    }
    comm_cost = {"D": times.dispatch_comm, "C": times.combine_comm}
    line, now, link, done = Timeline(), 0.0, 0.0, {}
    for step in steps:
        j = step.index
        if step.kind in waits:
            now = max(now, done[(waits[step.kind], j)])
        cost = compute_cost[step.kind][j] * _backward_factor(step.kind, backward)
        if step.kind is Kind.ATTEND:
            cost += times.attend_collectives[j]
        line.compute.append((str(step), now, now + cost))
        now += cost
        if step.kind in posts:
            name = posts[step.kind]
            start = max(link, now)
            link = start + comm_cost[name][j]
            done[(name, j)] = link
            line.comm.append((f"{name}{j}", start, link))
    return line


def _backward_factor(kind: Kind, backward: bool) -> float:
    if not backward:
        return 1.0
    return BACKWARD_ATTENTION_FACTOR if kind is Kind.ATTEND else BACKWARD_MATMUL_FACTOR


def block_seconds(
    shape: ModelShape, seq_len: int, schedule: MoEPipeline, degree: int, uniform: bool, c: Cluster
) -> tuple[float, float]:
    """Forward and backward seconds of one MoE block."""
    times = stage_times(shape, seq_len, schedule, degree, uniform, c)
    program = build_program(schedule, degree)
    return play(program, times).end, play(program, times, backward=True).end
