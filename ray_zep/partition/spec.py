"""What a placement is, in one record: `PlacementSpec`.

A spec holds a placement's axis traits (`ray_zep.parallel.axes.SequenceAxis`), its
planner, the layouts its plans use, how `ray-zep simulate` models it (`Variant`s by
name) and which benches list it by default (`Bench`). `ray_zep.partition.registry`
keeps every spec; the planners' entry point, the simulator's variant table, the
benches' default lists and the config's choices are all read from there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from ray_zep.config import ParallelConfig
from ray_zep.model_shapes import ModelShape
from ray_zep.options import DkvWire, ZonePolicy
from ray_zep.parallel.axes import Placement, SequenceAxis
from ray_zep.partition.layout import ZIGZAG, Layout
from ray_zep.partition.plan import AttentionPlan
from ray_zep.topology import Topology

Planner = Callable[[np.ndarray, Topology, int, ModelShape, ParallelConfig], AttentionPlan]
"""(lengths, topology, L, model shape, parallel config) -> the batch's plan."""


class Bench(Enum):
    """A bench (or command) whose default list of placements the registry gives."""

    SIMULATE = "simulate"
    """`ray-zep simulate` without --strategies."""
    TRAIN = "train"
    """`ray-zep bench train` without --strategies."""
    VALIDATE = "validate"
    """`ray-zep bench validate`: the modes trained and predicted."""
    VALIDATE_QUICK = "validate_quick"
    """`ray-zep bench validate --quick`."""
    LAYERS = "layers"
    """`ray-zep bench layers`: routing and remap on plans."""
    PARTITION = "partition"
    """`ray-zep bench partition`: planners on the paper's distributions."""
    SCALE = "scale"
    """`ray-zep bench scale`: 64 to 4,096 GPUs, modelled."""


class Role(Enum):
    """A part a placement plays in comparisons (each held by at most one placement)."""

    SYSTEM = "system"
    """The product's own placement: comparisons and headlines put it first."""
    REFERENCE = "reference"
    """The baseline every comparison is relative to (speedups are over it)."""
    PACKED = "packed"
    """Whole sequences packed per rank (data parallelism): the plain-packing baseline
    and what weights modes alone train."""


@dataclass(frozen=True)
class Variant:
    """A placement as `ray-zep simulate` models it: the routing and remapping layers
    on or off, and how the baselines' own systems run.

    Attributes:
        placement: the placement.
        routed, remap: `parallel.routing`, `parallel.remap`.
        te_wire: dK/dV travel in the activation dtype, as TransformerEngine sends them
            (`context_parallel.py`, AttnFuncWithCPAndKVP2P.backward: the dK/dV
            buffer is `torch.empty((2, *kv.shape), dtype=kv.dtype)`, accumulated and
            sent in bf16 with the next K/V); our engine accumulates and sends them in
            float32.
        te_padding: every sequence padded to a multiple of 2 x the ring's ranks, as
            TransformerEngine's THD format needs (`ray_zep.sim.megatron_cp.te_padded`);
            the padded batch is what TE trains, so a rank may hold more than L tokens.
        hybrid_cp: Megatron-Core's hybrid DP x CP waves (`ray_zep.sim.megatron_cp`),
            TE CP inside each group.
        bytescale: ByteScale's HDP micro-batches (`ray_zep.sim.bytescale`).
        dynamic_cp: Megatron-LM's packing-aware dynamic CP micro-batches
            (`ray_zep.sim.megatron_dynamic_cp`), TE CP inside each group.
        zone_policy: the `parallel.zone_policy` it plans with (None: the config's).
        dkv_wire: the `parallel.dkv_wire` it runs with (None: the config's).
    """

    placement: Placement
    routed: bool = False
    remap: bool = False
    te_wire: bool = False
    te_padding: bool = False
    hybrid_cp: bool = False
    bytescale: bool = False
    dynamic_cp: bool = False
    zone_policy: ZonePolicy | None = None
    dkv_wire: DkvWire | None = None

    @property
    def foreign(self) -> bool:
        """Models another system's runtime (TransformerEngine's wire, ByteScale's
        schedule): FSDP2's own prefetch, one block ahead when each block starts, not ours
        after its attention (`parallel.prefetch_after_attention`) or two ahead
        (`parallel.prefetch_depth`)."""
        return self.te_wire or self.bytescale

    @property
    def scheduled(self) -> bool:
        """Runs as several plans per step (waves, micro-batches), not one."""
        return self.hybrid_cp or self.bytescale or self.dynamic_cp


@dataclass(frozen=True)
class PlacementSpec:
    """Everything the package knows about one placement.

    Attributes:
        axis: the `parallel.sequence` value and its traits.
        planner: places a batch from its lengths; None: whole sequences from packed
            bins (`plan_from_bins`).
        layouts: the chunk layouts its plans use.
        variants: `ray-zep simulate`'s names for it and how each is modelled (empty:
            one variant of the placement's own name, every layer off).
        listed: the benches that list it by default, and under which variant names
            (empty: the placement's own name).
        role: the part it plays in comparisons, if any.
        zone_policies: the `parallel.zone_policy` values its planner tells apart
            (`plan --auto` tries each).
        reads: the `ParallelConfig` fields its planner reads (with L, the cluster and
            the model): compositions that agree on them share its plan of a batch in
            `plan --auto` (`ray_zep.partition.shared_plans`). None: it may read any
            field, and is run for every composition.
    """

    axis: SequenceAxis
    planner: Planner | None = None
    layouts: tuple[Layout, ...] = (ZIGZAG,)
    variants: Mapping[str, Variant] = field(default_factory=dict)
    listed: Mapping[Bench, tuple[str, ...]] = field(default_factory=dict)
    role: Role | None = None
    zone_policies: tuple[ZonePolicy, ...] = ()
    reads: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        """The placement's `parallel.sequence` value."""
        return self.axis.name

    def simulated(self) -> dict[str, Variant]:
        """Its variants by name: the placement's own name at least, none for
        whole-sequence placements (`simulate` models placements that split sequences)."""
        if self.axis.whole_sequences:
            return dict(self.variants)
        return dict(self.variants) or {self.name: Variant(self.axis.placement)}

    def names_in(self, bench: Bench) -> tuple[str, ...]:
        """The names `bench` lists by default (none when it does not list it)."""
        names = self.listed.get(bench)
        return () if names is None else names or (self.name,)


def listed_in(*benches: Bench) -> dict[Bench, tuple[str, ...]]:
    """`PlacementSpec.listed` for benches that list a placement under its own name."""
    return dict.fromkeys(benches, ())
