"""When FSDP2 gathers each unit's parameters during a step, on one rank of a gloo group."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group

from ray_zep.attention.kernels import torch_varlen_attention
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.config import load_config
from ray_zep.distributed import Comm, GroupNeeds, MeshShape
from ray_zep.model.llama import Transformer
from ray_zep.model_shapes import build_shape
from ray_zep.topology import build_topology
from ray_zep.train.fsdp import shard_model

TOKENS = 48


def gather_order(rank: int, world: int, overrides: list[str]) -> tuple[list[str], float, tuple]:
    """One forward and backward of a three-block model sharded over `world` ranks
    (`overrides` on a 1 x `world` topology): (in call order, each block's attention in
    the forward, `attention i`, and backward, `attention again`, each manual gather,
    `gather <unit>`: FSDP2's own prefetch calls no `FSDPModule.unshard`, the gather after
    attention does; and each all-gather FSDP2 issues, `all-gather <unit>` (the module's
    name, `layers.1`, `norm`, "" for the root); the loss; every element of this rank's
    gradient shards, parameter by parameter)."""
    topology_keys = ["topology.nodes=1", f"topology.gpus_per_node={world}"]
    config = load_config(None, [*topology_keys, "model.n_layers=3", "parallel.weights=fsdp",
                                *overrides])  # fmt: skip
    topology, shape = build_topology(config.topology), build_shape(config.model)
    comm = Comm.create(topology, world, 60.0).with_groups(GroupNeeds(fsdp=MeshShape.FLAT))
    torch.manual_seed(0)
    model = Transformer(shape)
    model.set_checkpointing(config.train.activation_checkpointing, 0)
    shard_model(model, comm, config.parallel, torch.device("cpu"), torch.float32)
    names = {id(block): f"block {i}" for i, block in enumerate(model.layers)}
    names[id(model.norm)] = "head"
    events: list[str] = []
    unshard = FSDPModule.unshard

    def noted_unshard(self, async_op: bool = False):
        events.append(f"gather {names.get(id(self), type(self).__name__)}")
        return unshard(self, async_op)

    issue = param_group.foreach_all_gather

    def noted_issue(fsdp_params, *args, **kwargs):
        owner = next((g for g in groups if g.fsdp_params is fsdp_params), None)
        events.append(f"all-gather {owner._module_fqn if owner is not None else '?'}")
        return issue(fsdp_params, *args, **kwargs)

    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules()
              if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group]  # fmt: skip
    calls = iter(range(shape.n_layers))

    def attention(q, k, v, seqs, causal):
        events.append("attention again" if "backward" in events else f"attention {next(calls)}")
        return torch_varlen_attention(q, k, v, seqs, causal=causal)

    seeded = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape.vocab_size, (TOKENS,), generator=seeded)
    FSDPModule.unshard = noted_unshard
    param_group.foreach_all_gather = noted_issue
    try:
        loss = model(tokens, torch.arange(TOKENS), PackedSeqs.from_lengths([TOKENS]), attention,
                     labels_T=tokens.roll(-1))  # fmt: skip
        events.append("backward")
        loss.backward()
    finally:
        FSDPModule.unshard = unshard
        param_group.foreach_all_gather = issue
    grads = tuple(p.grad.to_local().flatten().tolist() for p in model.parameters()
                  if p.grad is not None)  # fmt: skip
    return events, float(loss), grads
