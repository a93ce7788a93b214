"""Which device owns which weight shard.

The model is a chain of units: the token embedding, each block, then the
final norm with the output projection. The units are cut into P contiguous
shards of about equal parameter count, one per device.

TawPipe (grouped passing) groups the devices by node (D groups of G) and
interleaves the owners so consecutive shards live in different groups: shard s
belongs to group s mod D, on the device with local index s div D (device P_i of
group g_k owns W_((D*i + k) mod P) in the paper's numbering). The ring baseline
(and the simulator's flat layout of the FSDP comparison) gives shard s to device s.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from torch import nn

from ray_zep.errors import ConfigError
from ray_zep.parallel.axes import Passing


def model_units(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """The model's units in execution order, each as (name, modules)."""
    units = [("tok_embeddings", [model.tok_embeddings])]
    units += [(f"layers.{i}", [layer]) for i, layer in enumerate(model.layers)]
    units.append(("head", [model.norm, model.output]))
    return units


def cut_shards(unit_sizes: list[int], devices: int) -> list[range]:
    """Contiguous unit ranges, one per device, of about equal total size.

    Raises:
        ConfigError: fewer units than devices.
    """
    if len(unit_sizes) < devices:
        raise ConfigError(
            f"config key model.n_layers: a weight-passing mode gives every one of the "
            f"{devices} devices a shard of whole layers, but the model has only "
            f"{len(unit_sizes)} units (embedding, {len(unit_sizes) - 2} blocks, output); "
            f"use at least {devices - 2} layers or fewer devices"
        )
    prefix = [0]
    for size in unit_sizes:
        prefix.append(prefix[-1] + size)
    bounds = [0]
    for k in range(1, devices):
        lowest, highest = bounds[-1] + 1, len(unit_sizes) - (devices - k)
        target = prefix[-1] * k / devices
        bounds.append(min(range(lowest, highest + 1), key=lambda i: abs(prefix[i] - target)))
    bounds.append(len(unit_sizes))
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


@dataclass(frozen=True)
class WeightLayout:
    """Owners of the shards and the device groups of one way of passing weights.

    Attributes:
        passing: grouped (TawPipe) or ring (ring_relay); None: one flat group.
        units: unit ranges of each shard.
        owners: device that owns each shard.
        groups: devices of each group (TawPipe: one per node; else one group).
    """

    passing: Passing | None
    units: tuple[range, ...]
    owners: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]

    @classmethod
    def build(
        cls, passing: Passing | None, unit_sizes: list[int], nodes: int, gpus_per_node: int
    ) -> WeightLayout:
        devices = nodes * gpus_per_node
        units = tuple(cut_shards(unit_sizes, devices))
        if passing is Passing.GROUPED:
            owners = tuple((s % nodes) * gpus_per_node + s // nodes for s in range(devices))
            groups = tuple(
                tuple(range(n * gpus_per_node, (n + 1) * gpus_per_node)) for n in range(nodes)
            )
        else:
            owners = tuple(range(devices))
            groups = (tuple(range(devices)),)
        return cls(passing, units, owners, groups)

    @property
    def shards(self) -> int:
        return len(self.units)

    def shard_of(self, device: int) -> int:
        """The shard a device owns."""
        return self.owners.index(device)

    def group_of(self, device: int) -> int:
        return next(g for g, members in enumerate(self.groups) if device in members)

    def root(self, shard: int, group: int) -> int:
        """The device of `group` that receives `shard` from its owner and spreads it
        in the group (the owner itself in the owner's group): TawPipe's staging
        device, at the owner's local index so transfers spread over the devices."""
        owner = self.owners[shard]
        members = self.groups[group]
        if owner in members:
            return owner
        local = self.groups[self.group_of(owner)].index(owner)
        return members[local]
