"""The fixed cost of one ring step of the attention engine, measured on the engine.

A ring step costs more than its kernel and its transfer: the engine selects the
step's rows, allocates and accumulates the gradient buffers, posts and waits for
its messages, and on a virtual cluster whose ranks share a few cores each wait
costs a scheduling round. Here `ranks` gloo processes run the engine
(`ray_zep.attention.engine.run_attention`) forward and backward on one short
sequence zigzag-split over all of them (TE CP's plan), once with chunks of a few
tokens and once with chunks of `CHUNK_TOKENS[1]`; the time beyond what the simulator
models for that layer (`ray_zep.sim.program`), per ring step, is what a step costs
besides its kernel and its transfers: a fixed part (from the tiny chunks,
`Calibration.ring_step_s`) and a part per query row (from the larger ones,
`ComputeRates.ring_row_seconds`: the fp32 accumulators, copies and scheduling the
step functions alone do not show). The share of a core the processes got is probed
around the measurement (`ray_zep.bench.core_share`), so a host that lends fewer
cores meanwhile does not show up as a dearer ring step.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from ray_zep.config import Config
from ray_zep.dist.launch import free_port
from ray_zep.model.shapes import build_shape

CHUNK_TOKENS = (8, 256)
"""Tokens of each zigzag chunk in the two measurements (a rank holds two chunks)."""
ITERATIONS = 12
WARM_UP = 2


def _plan(config: Config, chunk: int):
    from ray_zep.parallel.axes import Placement
    from ray_zep.partition import make_plan
    from ray_zep.topology import build_topology

    topology = build_topology(config.topology)
    tokens = 2 * chunk * topology.world_size
    shape = build_shape(config.model)
    return make_plan(Placement.TE_CP, [tokens], topology, 2 * chunk, shape)


def _worker(rank: int, world: int, port: int, config: Config, chunk: int, result) -> None:
    import torch.distributed as dist

    from ray_zep.attention.engine import run_attention
    from ray_zep.attention.kernels import select_backward, select_kernel
    from ray_zep.attention.links import Links
    from ray_zep.attention.schedule import RankSchedule
    from ray_zep.dist import Comm

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    plan = _plan(config, chunk)
    comm = Comm.create(plan.topology, world, config.comm.timeout_s)
    kernel = select_kernel("auto", torch.device("cpu"), torch.float32)
    kernels = (kernel, select_backward(kernel))
    schedule = RankSchedule.build(plan, rank)
    shape, rows = build_shape(config.model), int(plan.rank_tokens()[rank])
    seconds = []
    for _ in range(ITERATIONS):
        q = torch.randn(rows, shape.n_heads, shape.head_dim, requires_grad=True)
        k, v = (torch.randn(rows, shape.n_kv_heads, shape.head_dim, requires_grad=True)
                for _ in range(2))  # fmt: skip
        dist.barrier()
        started = time.perf_counter()
        run_attention(q, k, v, schedule, Links(comm, None), kernels).sum().backward()
        seconds.append(time.perf_counter() - started)
    mean = torch.tensor([float(np.mean(seconds[WARM_UP:]))])
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    if rank == 0:
        result.append(float(mean))
    dist.barrier()
    dist.destroy_process_group()


def measure_layers(config: Config) -> list[float]:
    """Seconds of the engine's forward and backward of the layer of each chunk length of
    `CHUNK_TOKENS` (the slowest rank's mean), measured in one gloo process per rank of
    `config.topology`."""
    import torch.multiprocessing as mp

    measured = []
    for chunk in CHUNK_TOKENS:
        world = _plan(config, chunk).topology.world_size
        with mp.Manager() as manager:
            result = manager.list()
            args = (world, free_port(), config, chunk, result)
            mp.spawn(_worker, args=args, nprocs=world, join=True)
            measured.append(result[0])
    return measured


def ring_step_costs(config: Config, hardware, measured: list[float]) -> tuple[float, float]:
    """(seconds per ring step, seconds per query row and ring step) of `measured`
    (`measure_layers`) beyond what `hardware` models (module docstring)."""
    from ray_zep.routing.routes import Phase, RoutingPlan
    from ray_zep.sim.events import simulate
    from ray_zep.sim.program import LayerSetup, attention_graph

    shape = build_shape(config.model)
    extra = []
    for chunk, seconds in zip(CHUNK_TOKENS, measured, strict=True):
        plan = _plan(config, chunk)
        routing = RoutingPlan.build(plan, False, all_hops=True)
        setup = LayerSetup(plan, shape, hardware.cost(shape), hardware.rates, routing,
                           element_bytes=4)  # fmt: skip
        graphs = (attention_graph(setup, phase) for phase in Phase)
        modelled = sum(simulate(graph, hardware.pool).makespan for graph in graphs)
        extra.append(max(0.0, seconds - modelled) / (2 * plan.topology.world_size))
    per_step = extra[0]
    rows = 2 * (CHUNK_TOKENS[1] - CHUNK_TOKENS[0])
    return per_step, max(0.0, extra[1] - extra[0]) / rows


def with_ring_step(config: Config, calibration):
    """`calibration` with the measured ring step costs (`Calibration.ring_step_s`,
    `ComputeRates.ring_row_seconds`), restated at the calibration's core share: the
    share the ranks got while the engine ran is probed around it (the host may lend
    fewer cores by then), the kernels are modelled at that share, and what is left
    scales by that share over the calibration's."""
    probe = calibration.share_probe(build_shape(config.model))
    measured, share = probe.around(lambda: measure_layers(config), calibration.core_share)
    during = dataclasses.replace(calibration, run_share=share)
    per_step, per_row = ring_step_costs(config, during.hardware(config.topology), measured)
    to_calibration = share / calibration.core_share if calibration.core_share else 1.0
    rates = dataclasses.replace(calibration.rates, ring_row_seconds=per_row * to_calibration)
    return dataclasses.replace(calibration, rates=rates, ring_step_s=per_step * to_calibration)
