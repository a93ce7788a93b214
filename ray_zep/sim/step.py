"""A whole training step of any composition the trainer runs, from the plan it executes.

`simulate_batch` places a batch as the data actor does (`ray_zep.step_plan.
plan_placement`: the planner and the remap decision of the configured axes, as
`plan_step` makes them; whole-sequence placements keep the rank-packed bins) and plays
it:

    n_layers x (forward layer + backward layer) - drift + LM head + weights' exposed
    collectives + expert all-to-alls + optimizer update + fixed host work

- a layer is the task graph of `ray_zep.sim.program` (attention engine, routing,
  remap, linear modules with their element-wise work), with the weights mode's
  per-block collectives overlapped inside it (`ray_zep.sim.weights`); layers repeat
  with identical work, so one forward and one backward layer are played with every
  rank starting together (a rank that finishes a layer early could start the next
  one's linear modules sooner; its first transfer of the next layer waits for its
  peers anyway); across the layers, ranks that share no ring run ahead of one another
  as far as the weights' collectives let them (`ray_zep.sim.drift`: the drift);
- the LM head runs on each rank's linear-layout tokens (the slowest rank counts);
- MoE blocks exchange their tokens with the expert-parallel group by all-to-all
  before and after the experts, forward and backward (the rank with the most
  linear-layout tokens counts). Without FoldMoE (`parallel.moe_pipeline=none`)
  none of it is hidden; with it, each block plays the pipeline's program on that
  rank's tokens (`ray_zep.sim.moe_block.overhang_seconds`: micro-batches, token
  buffer and, where attention stays on the rank, time-uniform attention slices)
  and the step pays what the block then takes beyond its plain compute: the
  all-to-all time left exposed and the micro-batches' extra kernel calls.
  Placements whose attention runs through the engine overlap only the MoE
  micro-batches (aaam and 1a1m run as moe_only there, as in the trainer);
- weight-passing modes play `ray_zep.sim.weight_passing` on each rank's own
  sequences; the slowest rank counts;
- activation checkpointing (`train.activation_checkpointing`, on the first
  `train.checkpoint_blocks` blocks) adds what backward recomputes: `full` plays each
  such block's forward again, overlapped with nothing (its ring exchange included, as
  the trainer's recomputation reruns the engine); `selective` (the feed-forward part's
  matmuls and SwiGLU) and `linears` (every projection and the forward's element-wise
  work, not the attention) recompute on each rank its own tokens inside that block's
  backward, which is played once more with those tasks (`ray_zep.sim.layer_work`): a
  rank with slack in its backward absorbs them.

ZipCCL (`comm.compression`, `comm.compression_streams`): every stream of the
composed step goes zipped where the mode zips it (`ray_zep.sim.wire.WireCodec`):
ring K/V and dK/dV, direct and routed, the Ulysses and remap exchanges
(`ray_zep.sim.program`), FSDP2's all-gathers and reduce-scatters and the gradient
all-reduce (`ray_zep.sim.weights`) and the expert all-to-alls (`expert_seconds`).
Weight-passing modes send their shards plain here (`weight_shards` and
`shard_gradients` are not modelled).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from functools import partial

import numpy as np

from ray_zep.collectives.switcher import Kind
from ray_zep.config import Compression, Config, DkvWire, MoEPipeline, Precision, TrainConfig
from ray_zep.costmodel import (
    BACKWARD_LINEAR_FACTOR,
    BYTES_PER_ELEMENT,
    ComputeRates,
    head_flops_per_token,
)
from ray_zep.cycle_collection import without_cycle_collection
from ray_zep.model_shapes import ModelShape, build_shape
from ray_zep.options import ActivationCheckpointing, CompressionStream
from ray_zep.parallel.axes import SEQUENCE_AXES, WEIGHTS_AXES, Family, WeightsMode
from ray_zep.parallel.memory import fsdp_units
from ray_zep.partition import greedy_bins, plan_from_bins
from ray_zep.partition.node_reshard import reshards_to_node
from ray_zep.partition.plan import AttentionPlan
from ray_zep.prefetch_plan import run_gathers_after_attention, run_prefetch_depth
from ray_zep.remap.solver import RemapPlan
from ray_zep.routing.routes import Phase, RoutingPlan
from ray_zep.sim.drift import drifting_layers
from ray_zep.sim.events import CorePool, TaskGraph, Timeline, simulate
from ray_zep.sim.graph_builder import FP32_BYTES, LayerSetup
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.layer_work import RECOMPUTED_IN_BACKWARD
from ray_zep.sim.moe_block import BlockSpread, block_times, overhang_seconds
from ray_zep.sim.program import layer_graphs
from ray_zep.sim.ring_form import array_ring
from ray_zep.sim.weight_passing import ShardWire, Workload
from ray_zep.sim.weight_passing import simulate_step as weight_passing_step
from ray_zep.sim.weights import WeightsCost, weights_cost
from ray_zep.sim.wire import Stream, WireCodec, codec_bytes_s
from ray_zep.step_plan import plan_placement, whole_bins


@dataclass(frozen=True)
class RunModel:
    """What a simulated step needs besides its batch.

    Attributes:
        config: the run (axes, data capacity, precision).
        hardware: the cluster and one GPU's rates.
        shape: the model (`config.model`'s).
        element_bytes: bytes of an activation (and a gathered parameter): 2 in bf16.
        dkv_bytes: bytes of a dK/dV element on the wire (`parallel.dkv_wire`; float32 by
            default).
        on_gpu: the ranks are GPUs (the codec's rate, `codec_bytes_s`).
        dkv_owner: `parallel.dkv_wire=owner`: the items that can send each step's dK/dV
            straight to their owners, in the activation dtype, do (`QueueItem.owner_dkv`);
            the others pass accumulators of `dkv_bytes`.
    """

    config: Config
    hardware: Hardware
    shape: ModelShape
    element_bytes: int = BYTES_PER_ELEMENT
    dkv_bytes: int = FP32_BYTES
    on_gpu: bool = True
    dkv_owner: bool = False

    @classmethod
    def create(cls, config: Config, hardware: Hardware, on_gpu: bool = True) -> RunModel:
        """Activations in bf16 on a GPU unless `train.precision=fp32`; float32 on CPU;
        dK/dV on the wire as `parallel.dkv_wire` says."""
        bf16 = on_gpu and config.train.precision is not Precision.FP32
        element = BYTES_PER_ELEMENT if bf16 else FP32_BYTES
        wire = config.parallel.dkv_wire
        dkv = element if wire is DkvWire.COMPUTE else FP32_BYTES
        return cls(config, hardware, build_shape(config.model), element, dkv, on_gpu=on_gpu,
                   dkv_owner=wire is DkvWire.OWNER)  # fmt: skip

    def codec(self) -> WireCodec:
        """ZipCCL as `config.comm` sets it, at this device's codec rate."""
        hw = self.hardware
        rate = codec_bytes_s(hw.rates, hw.topology.gpu_model, self.on_gpu)
        return WireCodec.create(self.config.comm, rate)

    @property
    def dkv_wire(self) -> DkvWire:
        """The `parallel.dkv_wire` this run's ring dK/dV travel as (`with_te_wire`: the
        K/V dtype, whatever the config says)."""
        if self.dkv_owner:
            return DkvWire.OWNER
        return DkvWire.COMPUTE if self.dkv_bytes == self.element_bytes else DkvWire.FLOAT32

    def with_te_wire(self) -> RunModel:
        """dK/dV in the activation dtype, as TransformerEngine sends them
        (`context_parallel.py`, AttnFuncWithCPAndKVP2P.backward), not in float32 as
        our engine does, and nothing compressed (TE and NCCL send plain bytes, whatever
        `comm.compression` says): the TE CP baseline."""
        comm = dataclasses.replace(self.config.comm, compression=Compression.OFF)
        config = dataclasses.replace(self.config, comm=comm)
        return dataclasses.replace(self, config=config, dkv_bytes=self.element_bytes,
                                   dkv_owner=False)  # fmt: skip


@dataclass
class StepResult:
    """Simulated time of one training step.

    Attributes:
        tokens: tokens of the global batch.
        forward_layer_seconds: one layer's forward, slowest rank.
        backward_layer_seconds: one layer's backward, slowest rank.
        head_seconds: LM head forward + backward, slowest rank.
        grad_sync_seconds: the weights' collectives no compute hides.
        step_seconds: the whole step.
        forward, backward: the layer timelines (for per-rank pictures); None for
            weight-passing modes.
        remap: the remap plan used, if any.
        expert_seconds: the MoE blocks' all-to-alls, as far as no compute hides them (and
            the extra kernel calls of FoldMoE's micro-batches).
        optimizer_seconds: the optimizer update.
        fixed_seconds: the step's fixed host work (`ComputeRates.step_overhead_s`).
        recompute_seconds: what backward recomputes under activation checkpointing,
            every layer.
        micro_steps: a step of several micro-batches (`ray_zep.sim.micro_step`): each
            one's own step, whose parts this one sums; empty for one batch a step.
        plan: the attention plan played (None for weight-passing modes).
        drift_seconds: what the layers take less than n_layers x (forward + backward
            layer) where ranks run ahead of one another between the weights'
            collectives (`ray_zep.sim.drift`).
    """

    tokens: int
    forward_layer_seconds: float
    backward_layer_seconds: float
    head_seconds: float
    grad_sync_seconds: float
    step_seconds: float
    forward: Timeline | None
    backward: Timeline | None
    remap: RemapPlan | None = None
    expert_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    fixed_seconds: float = 0.0
    recompute_seconds: float = 0.0
    micro_steps: tuple[StepResult, ...] = ()
    plan: AttentionPlan | None = None
    drift_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.step_seconds if self.step_seconds > 0 else 0.0

    @property
    def timelines_whole(self) -> bool:
        """Whether `forward` and `backward` are the whole step's layers: None for
        weight-passing modes, only the first plan's where several plans' layers are summed
        (the baselines' waves and scheduled micro-batches)."""
        if self.forward is None or self.backward is None:
            return False
        own = (self.forward.makespan, self.backward.makespan)
        return bool(np.allclose(own, (self.forward_layer_seconds, self.backward_layer_seconds)))

    def breakdown(self, n_layers: int) -> dict[str, float]:
        """Seconds of the step by part."""
        return {
            "layers_forward": n_layers * self.forward_layer_seconds,
            "layers_backward": n_layers * self.backward_layer_seconds,
            "head": self.head_seconds,
            "grad_sync": self.grad_sync_seconds,
            "experts": self.expert_seconds,
            "optimizer": self.optimizer_seconds,
            "fixed": self.fixed_seconds,
            "recompute": self.recompute_seconds,
            "drift": -self.drift_seconds,
        }


@without_cycle_collection
def simulate_batch(
    lengths: np.ndarray, run: RunModel, bins: list[list[int]] | None = None
) -> StepResult:
    """One step of the configured composition on a batch of sequences of `lengths`.

    Args:
        lengths: the batch's sequence lengths, in admission order.
        run: the run and its hardware.
        bins: whole-sequence placements: the sequences each rank holds (rank
            packing); None: longest first onto the least-loaded rank.

    Raises:
        PlacementError: the batch does not fit the placement.
        ConfigError: the placement's rules fail.
    """
    parallel = run.config.parallel
    if WEIGHTS_AXES[parallel.weights].family is Family.WEIGHT_PASSING:
        bins = bins if bins is not None else greedy_bins(lengths, run.hardware.devices)
        return _weight_passing(lengths, bins, run)
    plan, remap = plan_batch(lengths, run, bins)
    return simulate_plan(plan, run, parallel.routing, remap)


def plan_batch(
    lengths: np.ndarray, run: RunModel, bins: list[list[int]] | None = None
) -> tuple[AttentionPlan, RemapPlan | None]:
    """The attention plan and remap the data actor makes of a batch (autograd family).

    Raises:
        PlacementError, ConfigError: as `simulate_batch`.
    """
    config, topology = run.config, run.hardware.topology
    parallel = config.parallel
    if SEQUENCE_AXES[parallel.sequence].whole_sequences:
        bins = bins if bins is not None else greedy_bins(lengths, topology.world_size)
        bins = whole_bins(np.asarray(lengths), bins, config, topology, run.shape)
        capacity = config.train.tokens_per_rank
        return plan_from_bins(lengths, bins, topology, capacity, parallel.sequence), None
    return plan_placement(np.asarray(lengths), config, topology, run.shape)


def simulate_plan(
    plan: AttentionPlan, run: RunModel, routed: bool = False, remap: RemapPlan | None = None
) -> StepResult:
    """One step of `plan` under `run`'s weights mode (autograd family), its ring transfers
    routed through proxies or direct, its linear modules on `remap`'s layout (None: the
    plan's)."""
    return simulate_plans(plan, [run], routed, remap)[0]


def ulysses_pieces(config: Config, shape: ModelShape) -> int:
    """The pieces a run's USP items exchange heads in (`parallel.ulysses_chunks`), where
    its blocks run them so: blocks as FSDP units, no `linears` checkpointing and no MoE
    pipeline (`ray_zep.model.llama.Block.plain_forward`); else 1 (whole)."""
    parallel = config.parallel
    piped = shape.moe_experts > 0 and parallel.moe_pipeline is not MoEPipeline.NONE
    linears = config.train.activation_checkpointing is ActivationCheckpointing.LINEARS
    return 1 if piped or linears else parallel.ulysses_pieces


@without_cycle_collection
def simulate_plans(
    plan: AttentionPlan,
    runs: list[RunModel],
    routed: bool = False,
    remap: RemapPlan | None = None,
) -> list[StepResult]:
    """`simulate_plan` under each of `runs`: one composition with different switches
    (`comm`, `parallel.moe_pipeline`). Its layer program is built once; runs on the
    same wire share their layers' timelines, and the others only work out the durations
    the wire changes again (`ray_zep.sim.program.layer_graphs`).

    Raises:
        ValueError: the runs differ in more than those switches.
    """
    base = runs[0]
    for run in runs[1:]:
        if _switched(run, base) != base:
            raise ValueError("simulate_plans: the runs differ in more than comm and moe_pipeline")
    shape, hw = base.shape, base.hardware
    cost = hw.cost(shape)
    codecs = [run.codec() for run in runs]
    by_codec = {codec: weights_of(base, codec) for codec in dict.fromkeys(codecs)}
    weights = [by_codec[codec] for codec in codecs]
    ring_on_arrays = partial(array_ring, topology=plan.topology, routed=routed)
    routing = RoutingPlan.build(plan, routed=routed, all_hops=True, skip=ring_on_arrays,
                                dkv_owner=base.dkv_owner)  # fmt: skip
    late = run_gathers_after_attention(base.config, hw.topology, shape, base.element_bytes)
    setup = LayerSetup(plan, shape, cost, hw.rates, routing, remap, base.element_bytes,
                       base.dkv_bytes, weights[0].layer_sync, weights[0].groups,
                       weights[0].layer_latency, codecs[0],
                       weight_groups_backward=weights[0].backward_groups,
                       dkv_owner=base.dkv_owner, gather_after_attention=late,
                       gathered_ahead=weights[0].gathered_ahead,
                       regathers=base.config.parallel.reshard_after_forward
                       and not weights[0].regather_in_node,
                       ulysses_chunks=ulysses_pieces(base.config, shape))  # fmt: skip
    wires = list(dict.fromkeys((c, w.layer_sync) for c, w in zip(codecs, weights, strict=True)))
    forward = _simulated(layer_graphs(setup, Phase.FORWARD, wires), hw.pool)
    backward = _simulated(layer_graphs(setup, Phase.BACKWARD, wires), hw.pool)
    recomputing = {  # the backward of a block that recomputes parts of its forward itself
        mode: _simulated(layer_graphs(dataclasses.replace(setup, recompute=mode),
                                      Phase.BACKWARD, wires), hw.pool)
        for mode in recomputed_blocks(base.config.train, shape)
    }  # fmt: skip
    tokens = setup.linear_tokens()
    head = head_seconds(max(tokens, default=0), shape, hw.rates)
    piped = any(r.config.parallel.moe_pipeline is not MoEPipeline.NONE for r in runs)
    lengths = _busiest_sequences(plan, tokens) if piped and remap is None else None
    results = []
    for run, codec, paid in zip(runs, codecs, weights, strict=True):
        wire = wires.index((codec, paid.layer_sync))
        layers = (forward[wire], backward[wire])
        experts = expert_seconds(run, tokens, lengths)
        again = {mode: timelines[wire] for mode, timelines in recomputing.items()}
        recompute = recompute_seconds(run, layers, again)
        results.append(_result(plan, run, layers, head, paid, experts, remap, recompute))
    return results


def weights_of(run: RunModel, codec: WireCodec | None = None) -> WeightsCost:
    """What the run's weights mode adds to its step, on `codec`'s wire (the run's own by
    default), as every simulated step charges it."""
    shape, hw, parallel = run.shape, run.hardware, run.config.parallel
    units = len(fsdp_units(shape, parallel.fsdp_unit))
    host = units * hw.rates.fsdp_unit_overhead_s
    ahead = run_prefetch_depth(run.config, hw.topology, shape, run.element_bytes)
    in_node = reshards_to_node(run.config, hw.topology, shape)
    return weights_cost(parallel.weights, shape, hw.cost(shape), run.element_bytes,
                        parallel.reshard_after_forward, host, codec or run.codec(),
                        ahead, in_node, parallel.shard_nodes)  # fmt: skip


def head_seconds(tokens, shape: ModelShape, rates: ComputeRates):
    """The LM head's forward + backward over `tokens` tokens (a count or an array of
    counts) at the matmul rate."""
    return (1 + BACKWARD_LINEAR_FACTOR) * tokens * head_flops_per_token(shape) / rates.matmul


def recompute_seconds(run: RunModel, layers: tuple[Timeline, Timeline], recomputing: dict) -> float:
    """What backward recomputes under the run's activation checkpointing (module
    docstring): the forward layer's makespan again in every `full` block, and in every
    block whose backward recomputes parts of its own forward (`selective`, `linears`;
    `train.checkpoint_rest` on the blocks after the first `train.checkpoint_blocks`) the
    makespan that backward (`recomputing`, by mode) takes beyond the plain one."""
    forward, backward = layers
    blocks = recomputed_blocks(run.config.train, run.shape)
    full = run.config.train.activation_checkpointing is ActivationCheckpointing.FULL
    seconds = run.config.train.checkpointed(run.shape.n_layers) * forward.makespan if full else 0.0
    for mode, count in blocks.items():
        seconds += count * (recomputing[mode].makespan - backward.makespan)
    return seconds


def recomputed_blocks(train: TrainConfig, shape: ModelShape) -> dict[ActivationCheckpointing, int]:
    """Blocks whose backward recomputes parts of their own forward, by mode (`selective`,
    `linears`): the first `train.checkpoint_blocks` under the mode, the rest under
    `train.checkpoint_rest`."""
    mode, blocks, rest = (
        train.activation_checkpointing,
        train.checkpoint_blocks,
        train.checkpoint_rest,
    )
    modes = (mode.on_block(index, blocks, rest) for index in range(shape.n_layers))
    return dict(Counter(m for m in modes if m in RECOMPUTED_IN_BACKWARD))


def _result(
    plan: AttentionPlan,
    run: RunModel,
    layers: tuple[Timeline, Timeline],
    head: float,
    paid: WeightsCost,
    experts: float,
    remap: RemapPlan | None,
    recompute: float = 0.0,
) -> StepResult:
    """A step of `plan` from its parts: (forward, backward) layer timelines, the LM head,
    what the weights mode costs, the expert all-to-alls and what backward recomputes."""
    forward, backward = layers
    rates = run.hardware.rates
    optimizer = paid.owned_params * rates.optimizer_param_seconds
    fixed = rates.step_overhead_s
    lockstep = run.shape.n_layers * (forward.makespan + backward.makespan)
    together = remap is not None or run.shape.moe_experts > 0
    total = drifting_layers(forward, backward, plan, run.shape.n_layers, paid.blocks_ahead,
                            together)  # fmt: skip
    return StepResult(
        tokens=int(plan.lengths.sum()),
        forward_layer_seconds=forward.makespan,
        backward_layer_seconds=backward.makespan,
        head_seconds=head,
        grad_sync_seconds=paid.exposed,
        step_seconds=total + head + paid.exposed + experts + optimizer + fixed + recompute,
        forward=forward,
        backward=backward,
        remap=remap,
        expert_seconds=experts,
        optimizer_seconds=optimizer,
        fixed_seconds=fixed,
        recompute_seconds=recompute,
        drift_seconds=lockstep - total,
        plan=plan,
    )


def _simulated(graphs: list[TaskGraph], pool: CorePool | None) -> list[Timeline]:
    """The timeline of each graph on `pool`, each graph object played once (wires that
    change no duration share the graph)."""
    played: dict[int, Timeline] = {}
    for graph in graphs:
        if id(graph) not in played:
            played[id(graph)] = _steady(graph, pool)
    return [played[id(graph)] for graph in graphs]


SPILL_PLAYS = 4
"""How many times a layer whose gather for a later block runs past its end is played at
most (`_steady`)."""


def _steady(graph: TaskGraph, pool: CorePool | None) -> Timeline:
    """The layer as it repeats: where its gather for a block two or more ahead runs past
    the layer's end, the one posted a layer earlier does too, into this layer
    (`TaskGraph.spill`); played again with that overrun until the overrun it plays is
    no more than the one it started from, or `SPILL_PLAYS` times."""
    timeline = simulate(graph, pool)
    spilled = 0.0
    for _ in range(SPILL_PLAYS - 1):
        over = timeline.overrun
        if not graph.spill or over <= spilled * (1 + 1e-6):
            break
        spilled = over
        timeline = simulate(graph.with_spill(spilled), pool)
    return timeline


def _switched(run: RunModel, like: RunModel) -> RunModel:
    """`run` with `like`'s switches (`comm`, `parallel.moe_pipeline`)."""
    config = like.config
    parallel = dataclasses.replace(run.config.parallel, moe_pipeline=config.parallel.moe_pipeline)
    return dataclasses.replace(
        run, config=dataclasses.replace(run.config, comm=config.comm, parallel=parallel)
    )


def _busiest_sequences(plan: AttentionPlan, tokens: list[int]) -> list[int] | None:
    """The lengths of the sequence pieces the rank with the most `tokens` holds."""
    if not tokens:
        return None
    return [f.length for f in plan.layout(int(np.argmax(tokens)))]


EXPERT_EXCHANGES = 4
"""All-to-alls per MoE block and step: dispatch and combine, forward and backward."""


def expert_seconds(run: RunModel, tokens: list[int], lengths: list[int] | None = None) -> float:
    """The MoE blocks' all-to-alls over the expert-parallel groups, as far as they are not
    hidden (module docstring), for the rank with the most `tokens`; `lengths`: the
    sequences it holds whole, which FoldMoE's aaam and 1a1m slice (None: one stream
    of its tokens). Each rank sends its tokens' top-k rows, all but its own share to
    the other members, zipped where `comm.compression` zips the `expert_all_to_all`
    stream (gradients in backward)."""
    shape, parallel = run.shape, run.config.parallel
    ep, schedule = parallel.ep, parallel.moe_pipeline
    if shape.moe_blocks == 0 or (ep <= 1 and schedule is MoEPipeline.NONE):
        return 0.0
    cost, codec = run.hardware.cost(shape), run.codec()
    name = CompressionStream.EXPERT_ALL_TO_ALL.value

    def exchange(elements: float, gradient: bool) -> float:
        """One dispatch or combine of `elements` values per rank. An all-to-all moves as
        much per rank as an all-gather of one peer's share per peer (ranks 0 .. ep - 1)."""
        nbytes = elements * run.element_bytes
        plain = cost.all_gather_seconds(nbytes / ep, range(ep))
        stream = Stream(name, run.element_bytes, gradient)
        return codec.collective_seconds(plain, cost, range(ep), Kind.ALL_TO_ALL, stream, nbytes)

    top = max(tokens, default=0)
    if schedule is MoEPipeline.NONE:
        values = top * shape.moe_top_k * shape.dim  # what each rank sends
        per_block = EXPERT_EXCHANGES / 2 * (exchange(values, False) + exchange(values, True))
        return shape.moe_blocks * per_block
    if not SEQUENCE_AXES[parallel.sequence].local_attention_only or lengths is None:
        # attention runs through the engine (or is not the rank's own): MoE micro-batches only
        lengths = [top]
        if schedule in (MoEPipeline.AAAM, MoEPipeline.ONE_A_ONE_M):
            schedule = MoEPipeline.MOE_ONLY
    block = 0.0
    for backward in (False, True):
        spread = BlockSpread(1, lambda n: 0.0, partial(exchange, gradient=backward))
        times_of = partial(
            block_times, shape, lengths, parallel.moe_uniform_slicing, run.hardware.rates, spread
        )
        block += overhang_seconds(times_of, schedule, parallel.moe_overlap_degree, backward)
    return shape.moe_blocks * block


def _weight_passing(lengths: np.ndarray, bins: list[list[int]], run: RunModel) -> StepResult:
    """Each rank's own sequences through the weight-passing step; the slowest rank counts."""
    mode: WeightsMode = run.config.parallel.weights
    recompute = run.config.parallel.shard_recompute
    wire = ShardWire(run.codec(), run.element_bytes)
    steps = []
    for group in bins:
        work = Workload(run.shape, tuple(int(lengths[i]) for i in group), 1.0, recompute)
        steps.append(weight_passing_step(mode, work, run.hardware, wire))
    slowest = max(steps, key=lambda s: s.seconds)
    owned = run.shape.param_count() / run.hardware.devices
    optimizer = owned * run.hardware.rates.optimizer_param_seconds
    return StepResult(
        tokens=int(np.asarray(lengths).sum()),
        forward_layer_seconds=0.0,
        backward_layer_seconds=0.0,
        head_seconds=0.0,
        grad_sync_seconds=slowest.seconds - slowest.compute_seconds,
        step_seconds=slowest.seconds + optimizer + run.hardware.rates.step_overhead_s,
        forward=None,
        backward=None,
        optimizer_seconds=optimizer,
        fixed_seconds=run.hardware.rates.step_overhead_s,
    )
