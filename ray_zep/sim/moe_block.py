"""Latency of one MoE block under a FoldMoE pipeline program, on a `Hardware` cluster.

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

The composed step (`ray_zep.sim.step`) plays the same programs on one rank's
own tokens (`BlockSpread`: no tensor parallelism, its expert-parallel group's
all-to-all) and charges what a pass takes beyond the plain block's compute
(`overhang_seconds`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ray_zep.config import MoEPipeline, TopologyConfig
from ray_zep.costmodel import (
    BACKWARD_ATTENTION_FACTOR,
    BACKWARD_LINEAR_FACTOR,
    BYTES_PER_ELEMENT,
    ComputeRates,
)
from ray_zep.model_shapes import ModelShape
from ray_zep.moe.schedule import Kind, Step, attention_slices, build_program
from ray_zep.moe.slicing import (
    micro_batch_sizes,
    slice_costs,
    time_uniform_slices,
    token_uniform_slices,
)
from ray_zep.sim.hardware import Hardware
from ray_zep.topology import build_topology


def foldmoe_testbed() -> Hardware:
    """The FoldMoE testbed: topology preset `foldmoe_a10g` with the A10G rates."""
    return Hardware.preset(build_topology(TopologyConfig(preset="foldmoe_a10g", nodes=2)))


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
    attend_backward_factor: float = BACKWARD_ATTENTION_FACTOR
    """Backward attention time per forward attention time."""


@dataclass
class Timeline:
    """Start and end of every step and transfer of one pass."""

    compute: list[tuple[str, float, float]] = field(default_factory=list)
    comm: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def end(self) -> float:
        return max((e for _, _, e in self.compute), default=0.0)


@dataclass(frozen=True)
class BlockSpread:
    """How one MoE block's work is spread over the GPUs (what `block_times` needs
    besides the model and the rates).

    Attributes:
        attention_gpus: GPUs that split every attention slice and micro-batch (tensor +
            sequence parallelism); 1: a rank attends over its own tokens.
        slice_collectives: seconds of the collectives around an attention slice of n
            tokens (the tensor-parallel gather and reduce-scatter).
        all_to_all: seconds of one GPU's dispatch (or combine) of `elements` values.
    """

    attention_gpus: int
    slice_collectives: Callable[[int], float]
    all_to_all: Callable[[float], float]


def testbed_spread(shape: ModelShape, hw: Hardware) -> BlockSpread:
    """The FoldMoE setup (module docstring): attention over a node's GPUs, experts on every
    GPU of every node, bf16 on the wire."""
    return BlockSpread(
        hw.gpus_per_node,
        lambda n: 2 * _ring_seconds(n * shape.dim * BYTES_PER_ELEMENT, hw),
        lambda elements: _all_to_all_seconds(elements * BYTES_PER_ELEMENT, hw),
    )


def stage_times(
    shape: ModelShape, seq_len: int, schedule: MoEPipeline, degree: int, uniform: bool, hw: Hardware
) -> StageTimes:
    """Per-GPU forward times of one MoE block of `shape` on a sequence of `seq_len`."""
    spread = testbed_spread(shape, hw)
    return block_times(shape, [seq_len], uniform, hw.rates, spread, schedule, degree)


def block_times(
    shape: ModelShape,
    lengths: Sequence[int],
    uniform: bool,
    rates: ComputeRates,
    spread: BlockSpread,
    schedule: MoEPipeline,
    degree: int,
) -> StageTimes:
    """Per-GPU forward times of one MoE block of `shape` on the packed sequences of
    `lengths` (slicing, micro-batches and the token buffer of `ray_zep.moe.slicing`)."""
    d = 1 if schedule is MoEPipeline.NONE else degree
    g, overhead_s = spread.attention_gpus, rates.call_overhead_s
    slices = _slices(shape, lengths, schedule, d, uniform)
    flops = slice_costs(lengths, slices, shape.dim, shape.n_heads, causal=True)
    attend = [f / g / rates.attention_forward + overhead_s for f in flops]
    gathered = [spread.slice_collectives(n) for n in slices]
    tokens = [n / g for n in micro_batch_sizes(int(sum(lengths)), d)]
    k, dim = shape.moe_top_k, shape.dim
    gate = [2 * dim * shape.moe_experts * n / rates.matmul + overhead_s for n in tokens]
    experts = [
        2 * 3 * dim * shape.expert_hidden * k * n / rates.matmul + overhead_s for n in tokens
    ]
    comm = [spread.all_to_all(n * k * dim) for n in tokens]
    overhead = [overhead_s] * d
    backward = BACKWARD_ATTENTION_FACTOR * rates.attention_forward / rates.attention_backward
    return StageTimes(attend, gathered, gate, experts, overhead, comm, list(comm), backward)


def _slices(shape, lengths, schedule, d, uniform) -> list[int]:
    total = int(sum(lengths))
    if attention_slices(schedule, d) == 1:
        return [total]
    if uniform:
        return time_uniform_slices(lengths, d, shape.dim, shape.n_heads)
    return token_uniform_slices(total, d)


def _ring_seconds(gathered_bytes: float, hw: Hardware) -> float:
    """A ring all-gather (or reduce-scatter) of `gathered_bytes` over a node's GPUs."""
    g = hw.gpus_per_node
    if g == 1:
        return 0.0
    return hw.intra_latency + gathered_bytes * (g - 1) / g / hw.intra_bandwidth


def _all_to_all_seconds(send_bytes: float, hw: Hardware) -> float:
    """One GPU's all-to-all of `send_bytes` spread evenly over every expert's GPU
    (experts span every GPU of every node)."""
    span, g = hw.devices, hw.gpus_per_node
    inter = send_bytes * (span - g) / span
    intra = send_bytes * (g - 1) / span
    nic_share = hw.node_nic_bandwidth / g
    latency = hw.inter_latency if hw.nodes > 1 else hw.intra_latency
    return latency + max(inter / nic_share, intra / hw.intra_bandwidth)


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
        cost = compute_cost[step.kind][j] * _backward_factor(step.kind, backward, times)
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


def _backward_factor(kind: Kind, backward: bool, times: StageTimes) -> float:
    if not backward:
        return 1.0
    return times.attend_backward_factor if kind is Kind.ATTEND else BACKWARD_LINEAR_FACTOR


def overhang_seconds(
    times_of: Callable[[MoEPipeline, int], StageTimes],
    schedule: MoEPipeline,
    degree: int,
    backward: bool = False,
) -> float:
    """Seconds one pass of an MoE block under `schedule` takes beyond the compute of the
    plain block (schedule none): the all-to-all time the compute stream waits for, and
    with micro-batches the kernel calls they add. Under none: its all-to-alls, whole.
    `times_of(schedule, degree)`: the block's stage times (`block_times` with all but its
    last two arguments bound)."""
    line = play(build_program(schedule, degree), times_of(schedule, degree), backward)
    plain = play(build_program(MoEPipeline.NONE, 1), times_of(MoEPipeline.NONE, 1), backward)
    return line.end - sum(end - start for _, start, end in plain.compute)


def block_seconds(
    shape: ModelShape, seq_len: int, schedule: MoEPipeline, degree: int, uniform: bool, hw: Hardware
) -> tuple[float, float]:
    """Forward and backward seconds of one MoE block."""
    times = stage_times(shape, seq_len, schedule, degree, uniform, hw)
    program = build_program(schedule, degree)
    return play(program, times).end, play(program, times, backward=True).end
