"""A whole training step of any composition the trainer runs, from the plan it executes.

`simulate_batch` places a batch as the data actor does (`ray_zep.parallel.step_plan.
plan_step`: the planner, the routing and the remap decision of the configured
axes; whole-sequence placements keep the rank-packed bins) and plays it:

    n_layers x (forward layer + backward layer) + LM head + weights' exposed
    collectives + expert all-to-alls + optimizer update + fixed host work

- a layer is the task graph of `ray_zep.sim.program` (attention engine, routing,
  remap, linear modules with their element-wise work), with the weights mode's
  per-block collectives overlapped inside it (`ray_zep.sim.weights`); layers repeat
  with identical work, so one forward and one backward layer are played with every
  rank starting together (a rank that finishes a layer early could start the next
  one's linear modules sooner; its first transfer of the next layer waits for its
  peers anyway);
- the LM head runs on each rank's linear-layout tokens (the slowest rank counts);
- MoE blocks exchange their tokens with the expert-parallel group by all-to-all
  before and after the experts, forward and backward; these are not overlapped
  (FoldMoE's overlap, `parallel.moe_pipeline`, is modelled per block by
  `ray_zep.sim.moe_block`, not in the composed step);
- weight-passing modes play `ray_zep.sim.weight_passing` on each rank's own
  sequences; the slowest rank counts.

ZipCCL compression (`comm.compression`) is not modelled in the composed step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ray_zep.config import Config, Precision
from ray_zep.costmodel import BACKWARD_LINEAR_FACTOR, BYTES_PER_ELEMENT, head_flops_per_token
from ray_zep.model.shapes import ModelShape, build_shape
from ray_zep.parallel.axes import SEQUENCE_AXES, WEIGHTS_AXES, Family, WeightsMode
from ray_zep.parallel.memory import fsdp_units
from ray_zep.parallel.step_plan import plan_step
from ray_zep.partition import greedy_bins, plan_from_bins
from ray_zep.partition.plan import AttentionPlan
from ray_zep.remap.solver import RemapPlan
from ray_zep.routing.routes import Phase, RoutingPlan
from ray_zep.sim.events import Timeline, simulate
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.program import FP32_BYTES, LayerSetup, layer_graph
from ray_zep.sim.weight_passing import Workload
from ray_zep.sim.weight_passing import simulate_step as weight_passing_step
from ray_zep.sim.weights import weights_cost


@dataclass(frozen=True)
class RunModel:
    """What a simulated step needs besides its batch.

    Attributes:
        config: the run (axes, data capacity, precision).
        hardware: the cluster and one GPU's rates.
        shape: the model (`config.model`'s).
        element_bytes: bytes of an activation (and a gathered parameter): 2 in bf16.
        dkv_bytes: bytes of a dK/dV element on the wire (our engine: float32).
    """

    config: Config
    hardware: Hardware
    shape: ModelShape
    element_bytes: int = BYTES_PER_ELEMENT
    dkv_bytes: int = FP32_BYTES

    @classmethod
    def create(cls, config: Config, hardware: Hardware, on_gpu: bool = True) -> RunModel:
        """Activations in bf16 on a GPU unless `train.precision=fp32`; float32 on CPU."""
        bf16 = on_gpu and config.train.precision is not Precision.FP32
        element = BYTES_PER_ELEMENT if bf16 else FP32_BYTES
        return cls(config, hardware, build_shape(config.model), element)

    def with_te_wire(self) -> RunModel:
        """dK/dV in the activation dtype, as TransformerEngine sends them
        (`context_parallel.py`, AttnFuncWithCPAndKVP2P.backward), not in float32 as
        our engine does: the TE CP baseline."""
        return dataclasses.replace(self, dkv_bytes=self.element_bytes)


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
        expert_seconds: the MoE blocks' all-to-alls.
        optimizer_seconds: the optimizer update.
        fixed_seconds: the step's fixed host work (`ComputeRates.step_overhead_s`).
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

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.step_seconds if self.step_seconds > 0 else 0.0

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
        }


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
        capacity = config.train.tokens_per_rank
        return plan_from_bins(lengths, bins, topology, capacity, parallel.sequence), None
    step = plan_step(np.asarray(lengths), config, topology, run.shape)
    return step.attention, step.remap


def simulate_plan(
    plan: AttentionPlan, run: RunModel, routed: bool = False, remap: RemapPlan | None = None
) -> StepResult:
    """One step of `plan` under `run`'s weights mode (autograd family), its ring transfers
    routed through proxies or direct, its linear modules on `remap`'s layout (None: the
    plan's)."""
    shape, hw = run.shape, run.hardware
    cost = hw.cost(shape)
    parallel = run.config.parallel
    units = len(fsdp_units(shape, parallel.fsdp_unit))
    host = units * hw.rates.fsdp_unit_overhead_s
    weights = weights_cost(parallel.weights, shape, cost, run.element_bytes,
                           parallel.reshard_after_forward, host)  # fmt: skip
    routing = RoutingPlan.build(plan, routed=routed, all_hops=True)
    setup = LayerSetup(plan, shape, cost, hw.rates, routing, remap, run.element_bytes,
                       run.dkv_bytes, weights.layer_sync, weights.groups)  # fmt: skip
    forward = simulate(layer_graph(setup, Phase.FORWARD))
    backward = simulate(layer_graph(setup, Phase.BACKWARD))
    head_tokens = max(setup.linear_tokens(), default=0)
    head_flops = (1 + BACKWARD_LINEAR_FACTOR) * head_tokens * head_flops_per_token(shape)
    head = head_flops / hw.rates.matmul
    experts = expert_seconds(run, setup.linear_tokens())
    optimizer = weights.owned_params * hw.rates.optimizer_param_seconds
    fixed = hw.rates.step_overhead_s
    layers = shape.n_layers * (forward.makespan + backward.makespan)
    return StepResult(
        tokens=int(plan.lengths.sum()),
        forward_layer_seconds=forward.makespan,
        backward_layer_seconds=backward.makespan,
        head_seconds=head,
        grad_sync_seconds=weights.exposed,
        step_seconds=layers + head + weights.exposed + experts + optimizer + fixed,
        forward=forward,
        backward=backward,
        remap=remap,
        expert_seconds=experts,
        optimizer_seconds=optimizer,
        fixed_seconds=fixed,
    )


EXPERT_EXCHANGES = 4
"""All-to-alls per MoE block and step: dispatch and combine, forward and backward."""


def expert_seconds(run: RunModel, tokens: list[int]) -> float:
    """The MoE blocks' all-to-alls over the expert-parallel groups (slowest rank): each
    sends its tokens' top-k rows, all but its own share to the other members."""
    shape, ep = run.shape, run.config.parallel.ep
    if shape.moe_blocks == 0 or ep <= 1:
        return 0.0
    cost = run.hardware.cost(shape)
    # one peer's share of the slowest rank's top-k rows; an all-to-all moves as much per
    # rank as an all-gather of one such block per peer (the group: ranks 0 .. ep - 1)
    block = max(tokens, default=0) * shape.moe_top_k * shape.dim * run.element_bytes / ep
    per_exchange = cost.all_gather_seconds(block, range(ep))
    return shape.moe_blocks * EXPERT_EXCHANGES * per_exchange


def _weight_passing(lengths: np.ndarray, bins: list[list[int]], run: RunModel) -> StepResult:
    """Each rank's own sequences through the weight-passing step; the slowest rank counts."""
    mode: WeightsMode = run.config.parallel.weights
    recompute = run.config.parallel.shard_recompute
    steps = []
    for group in bins:
        work = Workload(run.shape, tuple(int(lengths[i]) for i in group), 1.0, recompute)
        steps.append(weight_passing_step(mode, work, run.hardware))
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
