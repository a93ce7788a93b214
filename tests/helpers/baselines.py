"""A small slow cluster for the simulated scale baselines' tests (megatron_cp, bytescale)."""

from __future__ import annotations

import functools

from ray_zep.config import Config, load_config
from ray_zep.costmodel import ComputeRates
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.step import RunModel
from ray_zep.topology import build_topology

RATES = ComputeRates(
    4e9, 2e9, 8e9, 1e-5, "test", optimizer_param_seconds=1e-9, step_overhead_s=1e-3
)
L = 1000
"""Tokens per rank at most."""


@functools.cache
def small_config(sequence: str, nodes: int, gpus: int, weights: str = "replicated") -> Config:
    """`sequence` on nodes x gpus ranks of L tokens, slow links, no routing or remap."""
    overrides = [
        f"parallel.sequence={sequence}",
        f"parallel.weights={weights}",
        "parallel.routing=false",
        "parallel.remap=false",
        f"train.tokens_per_rank={L}",
        f"topology.nodes={nodes}",
        f"topology.gpus_per_node={gpus}",
        "topology.nic_gbits_per_s=8",
        "topology.intra_node_gbytes_per_s=4",
    ]
    return load_config("conf/demo.yaml", overrides)


def small_run(sequence: str, nodes: int = 2, gpus: int = 4) -> RunModel:
    """The run of `small_config` at `RATES`, with TE's dK/dV dtype on the wire."""
    config = small_config(sequence, nodes, gpus)
    hardware = Hardware(build_topology(config.topology), RATES)
    return RunModel.create(config, hardware, on_gpu=True).with_te_wire()
