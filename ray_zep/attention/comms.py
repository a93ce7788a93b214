"""Communication of the attention engine: point-to-point exchanges and KV collectives.

Every call is asynchronous where the backend allows it and waited on with the
Comm's timeout; a timeout or a lost peer becomes a CommError naming the peer and
`comm.timeout_s`. Ranks are global ranks of `comm.group`. Every call is tallied
in the schedule's `ops` counter, so tests can check that what ran is what the
plan implies.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ray_zep.mesh import Comm


class Pending:
    """Handles of posted operations; `wait` completes them all or raises CommError."""

    def __init__(self, works: list, comm: Comm, what: str) -> None:
        self._works, self._comm, self._what = works, comm, what

    def wait(self) -> None:
        self._comm.wait(self._works, self._what)
        self._works = []

    def extend(self, works: list) -> Pending:
        """These handles plus `works` (routed hops of the same exchange)."""
        self._works.extend(works)
        return self


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    comm: Comm,
    ops: Counter,
    what: str,
) -> Pending:
    """Post sends of (tensor, peer) and receives into (buffer, peer) together."""
    if not sends and not recvs:
        return Pending([], comm, what)
    p2p = [dist.P2POp(dist.isend, t.contiguous(), peer, comm.group) for t, peer in sends]
    p2p += [dist.P2POp(dist.irecv, buf, peer, comm.group) for buf, peer in recvs]
    ops["p2p"] += len(p2p)
    works = dist.batch_isend_irecv(p2p) if p2p else []
    return Pending(list(works), comm, what)


def all_gather_rows(local: torch.Tensor, rows: int, comm: Comm, ops: Counter) -> torch.Tensor:
    """Every rank's `local` (rows x ...), padded to `rows`, stacked by rank: (world, rows, ...)."""
    padded = local.new_zeros((rows, *local.shape[1:]))
    padded[: local.shape[0]] = local
    out = local.new_empty((comm.world_size * rows, *local.shape[1:]))
    ops["all_gather"] += 1
    work = dist.all_gather_single(out, padded, group=comm.group, async_op=True)
    Pending([work], comm, "all-gather of K/V").wait()
    return out.view(comm.world_size, rows, *local.shape[1:])


def reduce_scatter_rows(stacked: torch.Tensor, comm: Comm, ops: Counter) -> torch.Tensor:
    """Sum (world, rows, ...) over ranks and keep this rank's slice (rows, ...)."""
    out = stacked.new_empty(stacked.shape[1:])
    ops["reduce_scatter"] += 1
    flat = stacked.reshape(-1, *stacked.shape[2:]).contiguous()
    work = dist.reduce_scatter_single(
        out, flat, op=dist.ReduceOp.SUM, group=comm.group, async_op=True
    )
    Pending([work], comm, "reduce-scatter of dK/dV").wait()
    return out
