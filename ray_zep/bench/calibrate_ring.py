"""The fixed cost of one ring step of the attention engine, measured on the engine.

A ring step costs more than its kernel and its transfer: the engine selects the
step's rows, allocates and accumulates the gradient buffers, posts and waits for
its messages, and on a virtual cluster whose ranks share a few cores each wait
costs a scheduling round. Here `ranks` gloo processes run the engine
(`ray_zep.attention.engine.run_attention`) forward and backward on one short
sequence zigzag-split over all of them (TE CP's plan), with chunks of a few tokens
and with chunks of `CHUNK_TOKENS[1]` taking turns for `ROUNDS` rounds in the same
processes (one measurement swung by 0-11 us per query row between four calibrations
within minutes; the median of the rounds' fits holds; `bench validate` adds sittings
minutes apart, `RingSittings`, as the rounds of one sitting can all land on a slow
stretch of the host); the time beyond what the simulator
models for that layer (`ray_zep.sim.program`), per ring step, is what a step costs
besides its kernel and its transfers: a fixed part (from the tiny chunks,
`Calibration.ring_step_s`) and a part per query row (from the larger ones,
`ComputeRates.ring_row_seconds`: the fp32 accumulators, copies and scheduling the
step functions alone do not show). The share of a core the processes got is probed
around the measurement (`ray_zep.core_share`), so a host that lends fewer
cores meanwhile does not show up as a dearer ring step.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from ray_zep.bench.local_ranks import start_ranks
from ray_zep.config import Config
from ray_zep.distributed.launch import free_port
from ray_zep.model_shapes import build_shape

CHUNK_TOKENS = (8, 256)
"""Tokens of each zigzag chunk in the two measurements (a rank holds two chunks)."""
ROUNDS = 3
"""Rounds of the two measurements; each cost is the median of the rounds' fits."""
ITERATIONS = 8
WARM_UP = 2


def _plan(config: Config, chunk: int):
    from ray_zep.partition import make_plan, registry
    from ray_zep.topology import build_topology

    topology = build_topology(config.topology)
    tokens = 2 * chunk * topology.world_size
    shape = build_shape(config.model)
    return make_plan(registry.reference().axis.placement, [tokens], topology, 2 * chunk, shape)


def _worker(rank: int, world: int, port: int, config: Config, result) -> None:
    import torch.distributed as dist

    from ray_zep.attention.engine import run_attention
    from ray_zep.attention.kernels import select_backward, select_kernel
    from ray_zep.attention.links import Links
    from ray_zep.attention.schedule import RankSchedule
    from ray_zep.distributed import Comm

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    plans = [_plan(config, chunk) for chunk in CHUNK_TOKENS]
    comm = Comm.create(plans[0].topology, world, config.comm.timeout_s)
    kernel = select_kernel("auto", torch.device("cpu"), torch.float32)
    kernels = (kernel, select_backward(kernel))
    shape = build_shape(config.model)

    def layer_seconds(plan, iterations: int) -> float:
        """The median over `iterations` of this rank's forward and backward."""
        schedule, rows = RankSchedule.build(plan, rank), int(plan.rank_tokens()[rank])
        seconds = []
        for _ in range(iterations):
            q = torch.randn(rows, shape.n_heads, shape.head_dim, requires_grad=True)
            k, v = (torch.randn(rows, shape.n_kv_heads, shape.head_dim, requires_grad=True)
                    for _ in range(2))  # fmt: skip
            dist.barrier()
            started = time.perf_counter()
            run_attention(q, k, v, schedule, Links(comm, None), kernels).sum().backward()
            seconds.append(time.perf_counter() - started)
        return float(np.median(seconds))

    for plan in plans:
        layer_seconds(plan, WARM_UP)
    for _ in range(ROUNDS):
        medians = torch.tensor([layer_seconds(plan, ITERATIONS) for plan in plans])
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank's
        if rank == 0:
            result.append(medians.tolist())
    dist.barrier()
    dist.destroy_process_group()


def measure_layers(config: Config) -> list[list[float]]:
    """Per round, the seconds of the engine's forward and backward of the layer of each
    chunk length of `CHUNK_TOKENS` (the slowest rank's median), measured in one gloo
    process per rank of `config.topology`, the chunk lengths taking turns."""
    import torch.multiprocessing as mp

    world = _plan(config, CHUNK_TOKENS[0]).topology.world_size
    with mp.Manager() as manager:
        result = manager.list()
        start_ranks(_worker, (world, free_port(), config, result), world)
        return [list(r) for r in result]


def modelled_layers(config: Config, hardware) -> list[float]:
    """Seconds `hardware` models for the forward and backward of the layer of each chunk
    length of `CHUNK_TOKENS` (`ray_zep.sim.program`, on the cores the ranks share)."""
    from ray_zep.routing.routes import Phase, RoutingPlan
    from ray_zep.sim.events import simulate
    from ray_zep.sim.graph_builder import LayerSetup
    from ray_zep.sim.program import attention_graph

    shape = build_shape(config.model)
    modelled = []
    for chunk in CHUNK_TOKENS:
        plan = _plan(config, chunk)
        routing = RoutingPlan.build(plan, False, all_hops=True)
        setup = LayerSetup(plan, shape, hardware.cost(shape), hardware.rates, routing,
                           element_bytes=4)  # fmt: skip
        graphs = (attention_graph(setup, phase) for phase in Phase)
        modelled.append(sum(simulate(graph, hardware.pool).makespan for graph in graphs))
    return modelled


def ring_step_costs(
    measured: list[float], modelled: list[float], world: int
) -> tuple[float, float]:
    """(seconds per ring step, seconds per query row and ring step) of one round of
    `measure_layers` beyond what is `modelled` (module docstring), on `world` ranks."""
    extra = [max(0.0, m - sim) / (2 * world) for m, sim in zip(measured, modelled, strict=True)]
    rows = 2 * (CHUNK_TOKENS[1] - CHUNK_TOKENS[0])
    return extra[0], max(0.0, extra[1] - extra[0]) / rows


def with_ring_step(config: Config, calibration):
    """`calibration` with the ring step costs of one sitting (`measure_ring_costs`)."""
    return with_ring_costs(calibration, *measure_ring_costs(config, calibration))


def with_ring_costs(calibration, per_step: float, per_row: float):
    """`calibration` with these ring step costs (`Calibration.ring_step_s`,
    `ComputeRates.ring_row_seconds`), stated at the calibration's core share."""
    rates = dataclasses.replace(calibration.rates, ring_row_seconds=per_row)
    return dataclasses.replace(calibration, rates=rates, ring_step_s=per_step)


def measure_ring_costs(config: Config, calibration) -> tuple[float, float]:
    """(seconds per ring step, per query row and ring step) measured in one sitting of
    `ROUNDS` rounds (the median of their fits), restated at the calibration's core share:
    the share the ranks got while the engine ran is probed around it (the host may lend
    fewer cores by then), the kernels are modelled at that share, and what is left
    scales by that share over the calibration's."""
    probe = calibration.share_probe(build_shape(config.model))
    rounds, share = probe.around(lambda: measure_layers(config), calibration.core_share)
    hardware = dataclasses.replace(calibration, run_share=share).hardware(config.topology)
    modelled = modelled_layers(config, hardware)
    world = hardware.topology.world_size
    fits = np.array([ring_step_costs(measured, modelled, world) for measured in rounds])
    per_step, per_row = (float(x) for x in np.median(fits, axis=0))
    to_calibration = share / calibration.core_share if calibration.core_share else 1.0
    return per_step * to_calibration, per_row * to_calibration


@dataclasses.dataclass
class RingSittings:
    """The ring step costs measured in sittings minutes apart, the calibration's own first:
    `bench validate` adds a sitting beside each later pair of job runs, so that a host
    lending less for a few minutes moves one sitting, not the cost every ring mode is
    predicted with (the median of the sittings' costs)."""

    config: Config
    calibration: object
    """The calibration the first sitting's costs come from (`Calibration`)."""
    costs: list[tuple[float, float]]

    @classmethod
    def start(cls, config: Config, calibration) -> RingSittings:
        first = (calibration.ring_step_s, calibration.rates.ring_row_seconds)
        return cls(config, calibration, [first])

    def measure(self) -> None:
        """One more sitting; none on one rank, which has no ring (as `calibrate`)."""
        if self.calibration.ranks > 1:
            self.costs.append(measure_ring_costs(self.config, self.calibration))

    def median(self) -> tuple[float, float]:
        """(seconds per ring step, per query row): the median of the sittings' costs."""
        per_step, per_row = (float(x) for x in np.median(np.array(self.costs), axis=0))
        return per_step, per_row

    def applied(self, calibration):
        """`calibration` with the median of the sittings' costs."""
        return with_ring_costs(calibration, *self.median())

    def summary(self) -> str:
        listed = ", ".join(f"{row * 1e6:.1f}" for _, row in self.costs)
        median = self.median()[1] * 1e6
        return f"ring step per query row {listed} us in {len(self.costs)} sittings: {median:.1f} us"
