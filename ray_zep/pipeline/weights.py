"""Device-bound weight storage: a device keeps its own shard and borrows the others.

A borrowed shard's parameters keep their tensors (autograd saved them in
forward) but their storage is released to zero bytes between uses and
refilled in place before backward needs it again, so every view autograd
holds sees the refilled values. Shards travel as one flat buffer; a device
has one staging buffer, sized to the largest shard, that the transfer of the
next shard fills while the current one computes.

Shards and gradients travel in the compute dtype (bf16 under autocast, as
TawPipe sends its half-precision weights); the parameters, their gradients and
the optimizer keep theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ray_zep.parallel.pipeline_layout import WeightLayout, model_units


@dataclass
class WeightLedger:
    """Bytes of weight storage this device holds, sampled at every pipeline step."""

    own_bytes: int = 0
    staging_bytes: int = 0
    largest_shard_bytes: int = 0
    peak_bytes: int = 0


class ShardedWeights:
    """One device's view of the model's weights under a `WeightLayout`.

    Args:
        model: the full model, initialised identically on every device.
        layout: shard owners.
        device_rank: this device.
        dtype: what shards and gradients travel in (the compute dtype).
    """

    def __init__(
        self,
        model: nn.Module,
        layout: WeightLayout,
        device_rank: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        units = model_units(model)
        self.layout = layout
        self.mine = layout.shard_of(device_rank)
        self.units = [[units[u] for u in unit_range] for unit_range in layout.units]
        self.params: list[list[nn.Parameter]] = [
            [p for _, modules in shard for m in modules for p in m.parameters()]
            for shard in self.units
        ]
        self.numel = [sum(p.numel() for p in ps) for ps in self.params]
        like = self.params[self.mine][0]
        self.staging = torch.empty(max(self.numel), dtype=dtype, device=like.device)
        self.resident = {self.mine}
        for shard in range(layout.shards):
            if shard != self.mine:
                self.release(shard)
        size = like.element_size()
        self.ledger = WeightLedger(
            own_bytes=self.numel[self.mine] * size,
            staging_bytes=self.staging.numel() * self.staging.element_size(),
            largest_shard_bytes=max(self.numel) * size,
        )
        self.sample()

    def own_parameters(self) -> list[nn.Parameter]:
        return self.params[self.mine]

    def own_module(self) -> nn.Module:
        """A module holding only this device's shard, under the full model's names."""
        holder = nn.Module()
        for name, modules in self.units[self.mine]:
            if name.startswith("layers."):
                if not hasattr(holder, "layers"):
                    holder.layers = nn.ModuleDict()
                holder.layers[name.split(".")[1]] = modules[0]
            elif name == "head":
                holder.norm, holder.output = modules
            else:
                holder.tok_embeddings = modules[0]
        return holder

    def pack(self, shard: int, out: torch.Tensor) -> torch.Tensor:
        """The resident shard's weights, flat, in `out`."""
        flat = out[: self.numel[shard]]
        offset = 0
        for p in self.params[shard]:
            flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
            offset += p.numel()
        return flat

    def pack_gradients(self, shard: int) -> torch.Tensor:
        """The shard's gradients in one new flat tensor of the travel dtype (zeros
        where none arrived)."""
        grads = [
            p.grad.reshape(-1)
            if p.grad is not None
            else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            for p in self.params[shard]
        ]
        return torch.cat(grads).to(self.staging.dtype)

    def set_gradients(self, shard: int, flat: torch.Tensor | None) -> None:
        """Gradients of the shard from a flat tensor; None drops them (borrowed shards)."""
        offset = 0
        for p in self.params[shard]:
            if flat is None:
                p.grad = None
                continue
            p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype, copy=True)
            offset += p.numel()

    def materialize(self, shard: int, flat: torch.Tensor) -> None:
        """Refill a borrowed shard's storage from `flat` (no-op for the own shard)."""
        if shard in self.resident:
            return
        offset = 0
        with torch.no_grad():
            for p in self.params[shard]:
                p.untyped_storage().resize_(p.numel() * p.element_size())
                p.data.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self.resident.add(shard)

    def release(self, shard: int) -> None:
        """Free a borrowed shard's storage (the own shard stays)."""
        if shard == self.mine:
            return
        for p in self.params[shard]:
            p.untyped_storage().resize_(0)
        self.resident.discard(shard)

    def held_bytes(self) -> int:
        """Weight storage allocated right now: resident shards plus the staging buffer."""
        params = sum(p.untyped_storage().nbytes() for shard in self.params for p in shard)
        return params + self.staging.untyped_storage().nbytes()

    def sample(self) -> None:
        self.ledger.peak_bytes = max(self.ledger.peak_bytes, self.held_bytes())
