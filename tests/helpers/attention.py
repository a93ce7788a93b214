"""Ring attention against the single-device reference, on one rank of a gloo group."""

from __future__ import annotations

from contextlib import ExitStack
from unittest import mock

import numpy as np
import torch

from ray_zep.attention import ulysses
from ray_zep.attention.engine import run_attention
from ray_zep.attention.kernels import torch_varlen_attention, torch_varlen_attention_backward
from ray_zep.attention.links import Links
from ray_zep.attention.schedule import RankSchedule, expected_ops
from ray_zep.attention.varlen import PackedSeqs
from ray_zep.config import load_config
from ray_zep.distributed import Comm, GroupNeeds
from ray_zep.model_shapes import build_shape
from ray_zep.parallel.axes import Placement
from ray_zep.partition import make_plan
from ray_zep.partition.exchange import Exchange
from ray_zep.partition.plan import AttentionPlan
from ray_zep.routing.relay import open_channels
from ray_zep.routing.routes import RoutingPlan
from ray_zep.topology import build_topology

KERNELS = (torch_varlen_attention, torch_varlen_attention_backward)
PAD_ROWS = 3


def reference(lengths, heads, kv_heads, dim, seed):
    """Global q, k, v (sequence-major), output and gradients from one process."""
    g = torch.Generator().manual_seed(seed)
    total = int(sum(lengths))
    q = torch.randn(total, heads, dim, generator=g, requires_grad=True)
    k = torch.randn(total, kv_heads, dim, generator=g, requires_grad=True)
    v = torch.randn(total, kv_heads, dim, generator=g, requires_grad=True)
    dout = torch.randn(total, heads, dim, generator=g)
    out, _ = torch_varlen_attention(q, k, v, PackedSeqs.from_lengths(lengths), causal=True)
    (out * dout).sum().backward()
    return q, k, v, dout, out.detach()


def with_exchange(plan: AttentionPlan, exchange: Exchange) -> AttentionPlan:
    """`plan` with every group of several ranks exchanging by `exchange`."""
    placements = tuple(p._replace(exchange=exchange) if len(p.ranks) > 1 else p
                       for p in plan.placements)  # fmt: skip
    out = AttentionPlan(plan.planner, plan.topology, plan.tokens_per_rank, placements)
    out.validate()
    return out


def ring_rank(rank: int, world: int, case: dict) -> dict:
    """Run the engine on this rank's rows of the plan; return rows, outputs, grads, op counts."""
    overrides = [
        f"topology.nodes={case['nodes']}",
        f"topology.gpus_per_node={case['gpus']}",
        f"model.n_heads={case['heads']}",
        f"model.n_kv_heads={case['kv_heads']}",
        f"model.dim={case['heads'] * case['dim']}",
    ]
    config = load_config(None, overrides)
    topology = build_topology(config.topology)
    comm = Comm.create(topology, topology.world_size, 60.0)
    routed = bool(case.get("routing"))
    comm = comm.with_groups(GroupNeeds(routing=routed))
    links = Links(comm, open_channels(comm) if routed else None,
                  dkv_as_kv=bool(case.get("dkv_as_kv")),
                  dkv_to_owner=bool(case.get("dkv_to_owner")))  # fmt: skip
    lengths = case["lengths"]
    if "placements" in case:  # a plan written out by the test
        plan = AttentionPlan(Placement(case["strategy"]), topology, case["capacity"],
                             tuple(case["placements"]))  # fmt: skip
        plan.validate()
    else:
        plan = make_plan(Placement(case["strategy"]), lengths, topology, case["capacity"],
                         build_shape(config.model))  # fmt: skip
    if "exchange" in case:
        plan = with_exchange(plan, Exchange(case["exchange"]))
    q, k, v, dout, _ = reference(lengths, case["heads"], case["kv_heads"], case["dim"], 0)
    dtype = getattr(torch, case.get("dtype", "float32"))  # the rank's compute dtype
    q, k, v, dout = (x.detach().to(dtype) for x in (q, k, v, dout))
    starts = np.concatenate([[0], np.cumsum(lengths)])
    rows = np.concatenate(
        [np.arange(f.start, f.end) + starts[f.seq] for f in plan.layout(rank)] or [[]]
    ).astype(np.int64)
    index = torch.as_tensor(rows)

    def mine(x):  # this rank's rows plus padding rows of garbage
        pad = torch.full((PAD_ROWS, *x.shape[1:]), 7.0, dtype=x.dtype)
        return torch.cat((x.detach()[index], pad)).requires_grad_(True)

    lq, lk, lv = mine(q), mine(k), mine(v)
    owner = bool(case.get("dkv_to_owner"))
    routing = (
        RoutingPlan.build(plan, dkv_owner=owner).for_rank(rank) if case.get("routing") else None
    )
    schedule = RankSchedule.build(plan, rank, routing=routing)
    wires: dict[str, str] = {}
    with ExitStack() as patches:
        _watch_ulysses_wire(patches, wires, bool(case.get("ulysses_grads_in_float32")))
        out = run_attention(lq, lk, lv, schedule, links, KERNELS)
        upstream = torch.cat(
            (dout[index], torch.full((PAD_ROWS, *dout.shape[1:]), 5.0, dtype=dout.dtype))
        )
        (out * upstream).sum().backward()
    return {
        "wires": wires,
        "rows": rows,
        "out": out.detach(),
        "dq": lq.grad,
        "dk": lk.grad,
        "dv": lv.grad,
        "ops": dict(+schedule.ops),
        "expected_ops": dict(expected_ops(plan, rank, routing, owner)),
    }


def _watch_ulysses_wire(patches: ExitStack, wires: dict, float32: bool) -> None:
    """Notes the dtype each Ulysses exchange sends in (`wires[what]`); with `float32`, the
    engine returns dQ/dK/dV in float32 whatever `ulysses_gradient_dtype` would pick."""
    swap = ulysses._swap

    def watched(payload, *args):
        wires[args[-1]] = str(payload[0].dtype)
        return swap(payload, *args)

    patches.enter_context(mock.patch.object(ulysses, "_swap", watched))
    if float32:
        patches.enter_context(
            mock.patch.object(ulysses, "ulysses_gradient_dtype", lambda *_: torch.float32)
        )
