"""FSDP2's all-gather and reduce-scatter through the compression switch.

torch lets an FSDP unit take its collectives from the caller
(`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`, objects of
its `AllGather` / `ReduceScatter` protocols). These two hand the unit's flat
buffers to an `AdaptiveCollectives` over the unit's shard group, which moves
them zipped or plain per call (`comm.compression`) and counts them as the
`fsdp_all_gather` and `fsdp_reduce_scatter` streams. The all-gather only moves
bytes, so results are bit-identical; the zipped reduce-scatter sums in float32
in rank order, which differs from the backend's sum by rounding.

Both run synchronously and return no work handle, which FSDP2 accepts (it
waits only on handles it gets). A unit whose parameters span two meshes
(experts sharded over their replicas, `shard_placement_fn`) cannot take custom
collectives in torch: it keeps FSDP2's own, uncompressed and uncounted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ray_zep.collectives.adaptive import AdaptiveCollectives
from ray_zep.errors import CommError
from ray_zep.options import CompressionStream

log = logging.getLogger(__name__)


class _Switched:
    def __init__(self, collectives: AdaptiveCollectives) -> None:
        self.collectives = collectives
        self._ranks = dist.get_process_group_ranks(collectives.g.group)

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def _check(self, group: dist.ProcessGroup) -> None:
        if group is not self.collectives.g.group and (
            dist.get_process_group_ranks(group) != self._ranks
        ):
            raise CommError(
                "FSDP2 called a compressed collective on a group other than the unit's "
                "shard group; the units were sharded over another mesh"
            )


class SwitchedAllGather(_Switched, AllGather):
    """FSDP2's parameter all-gather as the `fsdp_all_gather` stream."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> None:
        self._check(group)
        stream = CompressionStream.FSDP_ALL_GATHER.value
        self.collectives.all_gather_into_(output_tensor, input_tensor, stream)


class SwitchedReduceScatter(_Switched, ReduceScatter):
    """FSDP2's gradient reduce-scatter (a plain sum) as the `fsdp_reduce_scatter` stream."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: object,
        async_op: bool = False,
    ) -> None:
        self._check(group)
        if op != dist.ReduceOp.SUM:
            raise CommError(f"the compressed FSDP reduce-scatter sums only; FSDP2 asked for {op}")
        stream = CompressionStream.FSDP_REDUCE_SCATTER.value
        self.collectives.reduce_scatter_into_(output_tensor, input_tensor, stream)


def switch_collectives(units: Sequence[FSDPModule], collectives: AdaptiveCollectives) -> int:
    """Give every unit with one parameter group the switched collectives.

    Returns:
        How many units kept FSDP2's own collectives (parameters over two meshes).
    """
    gather, scatter = SwitchedAllGather(collectives), SwitchedReduceScatter(collectives)
    kept = 0
    for unit in units:
        try:
            unit.set_custom_all_gather(gather)
            unit.set_custom_reduce_scatter(scatter)
        except ValueError:  # torch: "not supported with multiple param groups"
            kept += 1
    if kept:
        log.info(
            "compression: %d FSDP unit(s) hold parameters on two meshes (experts sharded "
            "over their replicas) and keep FSDP2's own uncompressed collectives",
            kept,
        )
    return kept
