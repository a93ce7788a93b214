"""A whole training step from one layer's simulated forward and backward.

Layers repeat with identical work, so the simulator plays one layer's forward
and one layer's backward (`ray_zep.sim.program`) with every rank starting
together, and a step takes

    n_layers x (forward layer + backward layer) + LM head + gradient all-reduce.

Starting every layer together is the one approximation of the composition: a
rank that finishes a layer early could start the next one's linear modules
sooner, but its first transfer of the next layer waits for its peers anyway.
The LM head runs on each rank's linear-layout tokens (the slowest rank counts),
and the gradients are all-reduced once after backward in float32, as the
trainer does (`ray_zep.train.comms.all_reduce_gradients_`). The optimizer
update is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_zep.costmodel import (
    BACKWARD_LINEAR_FACTOR,
    BYTES_PER_ELEMENT,
    GRAD_BYTES_PER_ELEMENT,
    ComputeRates,
    CostModel,
    head_flops_per_token,
)
from ray_zep.model.shapes import ModelShape
from ray_zep.partition.plan import AttentionPlan
from ray_zep.remap.solver import RemapPlan
from ray_zep.routing.routes import Phase, RoutingPlan
from ray_zep.sim.events import Timeline, simulate
from ray_zep.sim.program import LayerSetup, layer_graph


@dataclass
class StepResult:
    """Simulated time of one training step.

    Attributes:
        tokens: tokens of the global batch.
        forward_layer_seconds: one layer's forward, slowest rank.
        backward_layer_seconds: one layer's backward, slowest rank.
        head_seconds: LM head forward + backward, slowest rank.
        grad_sync_seconds: the gradient all-reduce.
        step_seconds: the whole step.
        forward, backward: the layer timelines (for per-rank pictures).
        remap: the remap plan used, if any.
    """

    tokens: int
    forward_layer_seconds: float
    backward_layer_seconds: float
    head_seconds: float
    grad_sync_seconds: float
    step_seconds: float
    forward: Timeline
    backward: Timeline
    remap: RemapPlan | None = None

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
        }


def simulate_step(
    plan: AttentionPlan,
    shape: ModelShape,
    rates: ComputeRates,
    routed: bool = False,
    remap_plan: RemapPlan | None = None,
    element_bytes: int = BYTES_PER_ELEMENT,
) -> StepResult:
    """Simulate one training step of `plan`, its ring transfers routed through proxies
    or direct, its linear modules on `remap_plan`'s layout (None: the plan's)."""
    topology = plan.topology
    cost = CostModel(shape, topology, rates.attention_forward)
    routing = RoutingPlan.build(plan, routed=routed, all_hops=True)
    setup = LayerSetup(plan, shape, cost, rates, routing, remap_plan, element_bytes)
    forward = simulate(layer_graph(setup, Phase.FORWARD))
    backward = simulate(layer_graph(setup, Phase.BACKWARD))
    head_tokens = max(setup.linear_tokens(), default=0)
    head = (1 + BACKWARD_LINEAR_FACTOR) * head_tokens * head_flops_per_token(shape) / rates.matmul
    grad_bytes = shape.param_count() * GRAD_BYTES_PER_ELEMENT
    grad_sync = cost.all_reduce_seconds(grad_bytes, range(topology.world_size))
    layers = shape.n_layers * (forward.makespan + backward.makespan)
    return StepResult(
        tokens=int(plan.lengths.sum()),
        forward_layer_seconds=forward.makespan,
        backward_layer_seconds=backward.makespan,
        head_seconds=head,
        grad_sync_seconds=grad_sync,
        step_seconds=layers + head + grad_sync,
        forward=forward,
        backward=backward,
        remap=remap_plan,
    )
