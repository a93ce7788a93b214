"""Collectives of the training step: gradient and statistics all-reduce.

Every call waits on its work handle with the Comm's timeout and turns a
timeout or a lost peer into a CommError that says which collective and which
config key sets the limit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ray_zep.mesh import Comm
from ray_zep.topology import LinkKind, Topology


def all_reduce_sum_(tensor: torch.Tensor, comm: Comm, what: str) -> torch.Tensor:
    """Sum `tensor` over the group in place (no-op for a single process)."""
    if not comm.distributed:
        return tensor
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=comm.group, async_op=True)
    comm.wait([work], f"all-reduce of {what}")
    return tensor


def all_reduce_gradients_(params: list[torch.nn.Parameter], comm: Comm) -> int:
    """Sum every parameter's gradient over the group, in one flat buffer.

    Parameters without a gradient (untouched by this rank's tokens) count as
    zeros, so every rank issues the same collective.

    Returns:
        Bytes of the gradient buffer (0 for a single process).
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not comm.distributed:
        return 0
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    all_reduce_sum_(flat, comm, "gradients")
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)
    return flat.numel() * flat.element_size()


def ring_all_reduce_link_bytes(nbytes: int, topology: Topology, world: int) -> dict[LinkKind, int]:
    """Bytes a ring all-reduce of `nbytes` per rank moves over each link kind, whole job.

    A ring all-reduce sends 2 (N-1)/N x nbytes from every rank to its successor;
    ranks are ordered node-major, so `nodes` of the N ring links cross nodes
    (none when there is one node). This is the volume of the ring algorithm;
    NCCL may pick a tree for some sizes, which moves the same order of bytes.
    """
    if world <= 1:
        return {LinkKind.INTRA_NODE: 0, LinkKind.INTER_NODE: 0}
    per_link = 2 * (world - 1) * nbytes // world
    crossing = topology.nodes if topology.nodes > 1 else 0
    return {
        LinkKind.INTRA_NODE: per_link * (world - crossing),
        LinkKind.INTER_NODE: per_link * crossing,
    }
