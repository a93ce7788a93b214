"""The fixed cost of one ring step of the attention engine, measured on the engine.

A ring step costs more than its kernel and its transfer: the engine selects the
step's rows, allocates and accumulates the gradient buffers, posts and waits for
its messages, and on a virtual cluster whose ranks share a few cores each wait
costs a scheduling round. Here `ranks` gloo processes run the engine
(`ray_zep.attention.engine.run_attention`) forward and backward on one short
sequence zigzag-split over all of them (TE CP's plan), so that almost nothing
but the steps' fixed costs remains; the time beyond what the simulator models for
that layer (`ray_zep.sim.program`), per ring step, is the cost of a step the
simulator adds to every ring step (`ComputeRates.call_overhead_s`).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from ray_zep.config import Config
from ray_zep.dist.launch import free_port

CHUNK_TOKENS = 8
"""Tokens of each zigzag chunk (a rank holds two)."""
ITERATIONS = 12
WARM_UP = 2


def _plan(config: Config):
    from ray_zep.model.shapes import build_shape
    from ray_zep.parallel.axes import Placement
    from ray_zep.partition import make_plan
    from ray_zep.topology import build_topology

    topology = build_topology(config.topology)
    tokens = 2 * CHUNK_TOKENS * topology.world_size
    shape = build_shape(config.model)
    return make_plan(Placement.TE_CP, [tokens], topology, 2 * CHUNK_TOKENS, shape)


def _worker(rank: int, world: int, port: int, config: Config, result) -> None:
    import torch.distributed as dist

    from ray_zep.attention.engine import run_attention
    from ray_zep.attention.kernels import select_backward, select_kernel
    from ray_zep.attention.links import Links
    from ray_zep.attention.schedule import RankSchedule
    from ray_zep.dist import Comm
    from ray_zep.model.shapes import build_shape

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    plan = _plan(config)
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


def measure_ring_step(config: Config, hardware) -> float:
    """Seconds a ring step costs beyond what `hardware` models for it (module docstring)."""
    import torch.multiprocessing as mp

    from ray_zep.model.shapes import build_shape
    from ray_zep.routing.routes import Phase, RoutingPlan
    from ray_zep.sim.events import simulate
    from ray_zep.sim.program import LayerSetup, attention_graph

    plan = _plan(config)
    world = plan.topology.world_size
    port = free_port()
    with mp.Manager() as manager:
        result = manager.list()
        mp.spawn(_worker, args=(world, port, config, result), nprocs=world, join=True)
        measured = result[0]
    shape = build_shape(config.model)
    setup = LayerSetup(plan, shape, hardware.cost(shape), hardware.rates,
                       RoutingPlan.build(plan, False, all_hops=True), element_bytes=4)  # fmt: skip
    modelled = sum(simulate(attention_graph(setup, phase)).makespan for phase in Phase)
    return max(0.0, measured - modelled) / (2 * world)


def with_ring_step(config: Config, calibration) -> object:
    """`calibration` with the measured ring step cost added to its per-call cost."""
    hardware = calibration.hardware(config.topology)
    extra = measure_ring_step(config, hardware)
    rates = dataclasses.replace(
        calibration.rates, call_overhead_s=calibration.rates.call_overhead_s + extra
    )
    return dataclasses.replace(calibration, rates=rates)
