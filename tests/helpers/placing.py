"""How a rank's trainer makes its weights, on one rank of a gloo group."""

from __future__ import annotations

import torch

from ray_zep.config import load_config
from ray_zep.model.hf import load_hf_weights
from ray_zep.model.llama import Transformer
from ray_zep.model_shapes import build_shape
from ray_zep.topology import build_topology
from ray_zep.train import build
from ray_zep.train.build import seeded
from ray_zep.train.setup import create_comm
from ray_zep.train.trainer import RankTrainer
from tests.helpers.training import full_state

TIMEOUT_S = 60.0


def made_weights(rank: int, world: int, overrides: list[str]) -> tuple[list[str], bool, str]:
    """A trainer built on a 1 x `world` topology with `overrides`: (in call order, each
    move of its whole model to a device, `model.to`, each `shard_model`, `shard`, and each
    making of its weights, `make`; whether its weights, gathered whole, equal the whole
    model made at once, `init_weights` or `load_hf_weights`, bit for bit; what differs
    where not)."""
    config = load_config(None, ["topology.nodes=1", f"topology.gpus_per_node={world}",
                                *overrides])  # fmt: skip
    topology = build_topology(config.topology)
    events: list[str] = []
    to, shard, make = torch.nn.Module.to, build.shard_model, build.draw_own_parts

    def noted_to(self, *args, **kwargs):
        if isinstance(self, Transformer):
            events.append("model.to")
        return to(self, *args, **kwargs)

    def noted(event: str, call):
        def noting(*args, **kwargs):
            events.append(event)
            return call(*args, **kwargs)

        return noting

    torch.nn.Module.to = noted_to
    build.shard_model, build.draw_own_parts = noted("shard", shard), noted("make", make)
    try:
        trainer = RankTrainer(config, create_comm(config, topology, TIMEOUT_S), torch.device("cpu"))
    finally:  # the pooled process serves other tests after this one
        torch.nn.Module.to = to
        build.shard_model, build.draw_own_parts = shard, make
    made = full_state(trainer.model)
    reference = Transformer(build_shape(config.model))  # made whole, at once
    if config.model.init_from:
        load_hf_weights(reference, config.model.init_from)
    else:
        reference.init_weights(seeded(config))
    whole = reference.state_dict()
    for name, value in whole.items():
        moe = trainer.model.get_submodule(name.rsplit(".", 2)[0]) if ".experts." in name else None
        if moe is not None and moe.ep is not None:  # this rank's experts only
            value = value[moe.first_expert : moe.first_expert + made[name].shape[0]]
        if not torch.equal(made[name], value):
            return events, False, name
    return events, set(made) == set(whole), ""
