"""Where a rank's trainer puts its weights, and when, on one rank of a gloo group."""

from __future__ import annotations

import torch

from ray_zep.config import load_config
from ray_zep.model.llama import Transformer
from ray_zep.topology import build_topology
from ray_zep.train import build
from ray_zep.train.setup import create_comm
from ray_zep.train.trainer import RankTrainer

TIMEOUT_S = 60.0


def placing_order(rank: int, world: int, overrides: list[str]) -> tuple[list[str], list[str]]:
    """A trainer built on a 1 x `world` topology with `overrides`: (in call order, each
    move of the whole model, `model.to`, and each `shard_model`, `shard`; the devices its
    parameters and buffers are on after the build)."""
    config = load_config(None, ["topology.nodes=1", f"topology.gpus_per_node={world}",
                                *overrides])  # fmt: skip
    topology = build_topology(config.topology)
    events: list[str] = []
    to, shard = torch.nn.Module.to, build.shard_model

    def noted_to(self, *args, **kwargs):
        if isinstance(self, Transformer):
            events.append("model.to")
        return to(self, *args, **kwargs)

    def noted_shard(*args, **kwargs):
        events.append("shard")
        return shard(*args, **kwargs)

    torch.nn.Module.to, build.shard_model = noted_to, noted_shard
    try:
        trainer = RankTrainer(config, create_comm(config, topology, TIMEOUT_S), torch.device("cpu"))
    finally:  # the pooled process serves other tests after this one
        torch.nn.Module.to, build.shard_model = to, shard
    model = trainer.model
    devices = {str(t.device) for t in (*model.parameters(), *model.buffers())}
    return events, sorted(devices)
