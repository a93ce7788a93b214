"""Collectives of the training step: gradient and statistics all-reduce.

Every call waits on its work handle with the Comm's timeout and turns a
timeout or a lost peer into a CommError that says which collective and which
config key sets the limit.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ray_zep.collectives.adaptive import AdaptiveCollectives
from ray_zep.collectives.ops import (
    all_reduce_sum_,
    gradients_or_zeros,
    reduce_in_one_buffer_,
)
from ray_zep.distributed import Comm
from ray_zep.options import CompressionStream

GRADIENTS = CompressionStream.GRADIENTS.value


def sum_over_ranks_(tensor: torch.Tensor, comm: Comm, what: str) -> torch.Tensor:
    """Sum `tensor` over the job's ranks in place (no-op for a single process)."""
    return all_reduce_sum_(tensor, comm.world, what) if comm.distributed else tensor


def all_reduce_gradients_(
    params: list[torch.nn.Parameter], comm: Comm, zipped: AdaptiveCollectives | None = None
) -> int:
    """Sum every parameter's gradient over the group, in one flat buffer.

    Parameters without a gradient (untouched by this rank's tokens) count as
    zeros, so every rank issues the same collective. With `zipped`
    (`comm.compression` on), the sum may travel compressed.

    Returns:
        Bytes of the gradient buffer (0 for a single process).
    """
    grads = gradients_or_zeros(params)
    if not comm.distributed:
        return 0
    if zipped is None:
        return reduce_in_one_buffer_(grads, lambda flat: sum_over_ranks_(flat, comm, GRADIENTS))
    return reduce_in_one_buffer_(grads, lambda flat: zipped.all_reduce_sum_(flat, GRADIENTS))


def square_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Squared L2 norm of the parameters' whole gradients, float64.

    Gradients sharded by FSDP2 (DTensors) count whole: the sum of squares of each
    mesh's shards is reduced over that mesh (a collective over the mesh's ranks),
    so every rank of the mesh gets the same figure.
    """
    total = torch.zeros((), dtype=torch.float64)
    by_mesh: dict[int | None, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            mesh = id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(p.grad)
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total += norm.double().cpu() ** 2
    return total
