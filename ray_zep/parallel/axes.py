"""The parallelism axes of a run, each value declared once.

A run is one point in a product of independent axes (as TorchTitan composes
FSDP2 x CP x TP x EP and Megatron-Core DP x CP x EP x PP):

    parallel.sequence   how a batch's tokens are placed over the ranks
    parallel.weights    where parameters, gradients and optimizer state live
    parallel.ep, parallel.moe_pipeline, parallel.routing, parallel.remap

This module spells the names of the built-in sequence placements and of the
weights modes, each declared once with the facts the rest of the package needs
(`SEQUENCE_AXES`, `WEIGHTS_AXES`); a placement defined elsewhere declares its
value with `declare_placement`. The config checks a run against `refusal`; the
planners, step runners, traffic and memory models look a value's traits up
instead of branching on names. What each value does is implemented where its
concern lives: `ray_zep.partition.registry` holds every placement's spec
(planner, layouts, simulator variants, bench listings), `ray_zep.train.fsdp`
shards the FSDP2 modes, `ray_zep.pipeline` runs the weight-passing family, and
`ray_zep.parallel.memory` models each mode's per-rank memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Placement(Enum):
    """`parallel.sequence`: how a global batch's tokens are placed over the ranks."""

    SINGLE = "single"
    WHOLE = "whole"
    ZEPPELIN = "zeppelin"
    TE_CP = "te_cp"
    LLAMA_CP = "llama_cp"
    HYBRID_DP = "hybrid_dp"
    ULYSSES = "ulysses"
    USP = "usp"
    FILL = "fill"


BUILT_IN_PLACEMENTS = frozenset(p.value for p in Placement)
"""The values of the placements declared here."""


class WeightsMode(Enum):
    """`parallel.weights`: where parameters, gradients and optimizer state live."""

    REPLICATED = "replicated"
    FSDP = "fsdp"
    HSDP = "hsdp"
    TAWPIPE = "tawpipe"
    RING_RELAY = "ring_relay"


class Family(Enum):
    """How a step runs under a weights mode."""

    AUTOGRAD = "autograd"
    """One forward and backward through the whole model (FSDP2 hooks gather and
    scatter the shards where the weights are sharded)."""
    WEIGHT_PASSING = "weight_passing"
    """Shard by shard: each rank owns a shard of layers that travels to the others
    as they need it (ray_zep.pipeline)."""


class Sharding(Enum):
    """Over which ranks a weights mode splits parameters and optimizer state."""

    NONE = "none"
    """Every rank holds everything."""
    ALL_RANKS = "all_ranks"
    """One shard per rank."""
    NODE = "node"
    """One shard per GPU of a node; nodes hold replicas."""
    OWNER = "owner"
    """Whole layers per rank (weight passing): each rank stores only its own."""


class Passing(Enum):
    """How a weight-passing mode moves shards between ranks."""

    GROUPED = "grouped"
    """TawPipe: broadcast inside a node, point to point between nodes."""
    RING = "ring"
    """Relayed hop by hop around one ring of all ranks, every rank computing the same
    shard (ring_relay)."""


@dataclass(frozen=True)
class SequenceAxis:
    """One value of `parallel.sequence` and its traits.

    Attributes:
        placement: the value.
        summary: one line for the docs and `ray-zep plan`.
        one_process: the whole batch trains in one process (the reference).
        whole_sequences: every sequence stays on one rank (batches are rank-packed).
        local_attention_only: attention never communicates; FoldMoE can slice it.
        ranks_apart: its plans leave ranks that share no exchange in a layer (whole
            sequences, rings over some ranks), which run ahead of one another across
            blocks as far as the weights' collectives let them (`ray_zep.sim.drift`):
            the unset `parallel.prefetch_depth` gathers deeper for them
            (`ray_zep.prefetch_plan.DEFAULT_PREFETCH_DEPTH`).
    """

    placement: Placement
    summary: str
    one_process: bool = False
    whole_sequences: bool = False
    local_attention_only: bool = False
    ranks_apart: bool = False

    def processes(self, gpus: int) -> int:
        """Processes the placement runs on a cluster of `gpus` GPUs."""
        return 1 if self.one_process else gpus

    @property
    def planned(self) -> bool:
        """A planner places the batch (sequences may span ranks; routing and remap apply)."""
        return not self.whole_sequences

    @property
    def name(self) -> str:
        return self.placement.value


@dataclass(frozen=True)
class WeightsAxis:
    """One value of `parallel.weights` and its traits.

    Attributes:
        mode: the value.
        summary: one line for the docs and `ray-zep plan`.
        family: how a step runs.
        sharding: over which ranks parameters and optimizer state are split.
        passing: how shards travel (weight-passing modes only).
    """

    mode: WeightsMode
    summary: str
    family: Family
    sharding: Sharding
    passing: Passing | None = None

    @property
    def name(self) -> str:
        return self.mode.value

    @property
    def fsdp(self) -> bool:
        """Parameters sharded by torch's FSDP2 (`fully_shard`)."""
        return self.family is Family.AUTOGRAD and self.sharding is not Sharding.NONE


SEQUENCE_AXES: dict[Placement, SequenceAxis] = {
    axis.placement: axis
    for axis in (
        SequenceAxis(
            Placement.SINGLE,
            "one process trains the whole global batch: the reference every run is tested against",
            one_process=True,
            whole_sequences=True,
            local_attention_only=True,
        ),
        SequenceAxis(
            Placement.WHOLE,
            "whole sequences packed per rank (data parallelism)",
            whole_sequences=True,
            local_attention_only=True,
            ranks_apart=True,
        ),
        SequenceAxis(
            Placement.ZEPPELIN,
            "hierarchical partitioner: local, intra-node and inter-node rings (Zeppelin)",
            ranks_apart=True,
        ),
        SequenceAxis(
            Placement.TE_CP,
            "every sequence zigzag-split over one global ring (Transformer Engine CP)",
        ),
        SequenceAxis(
            Placement.LLAMA_CP,
            "every sequence zigzag-split, K and V all-gathered before attention (LLaMA-3)",
        ),
        SequenceAxis(
            Placement.HYBRID_DP,
            "short sequences whole on FLOP-balanced ranks, long ones on ring groups",
            ranks_apart=True,
        ),
        SequenceAxis(
            Placement.ULYSSES,
            "every sequence split over all ranks, heads exchanged by all-to-all (Ulysses)",
        ),
        SequenceAxis(
            Placement.USP,
            "Ulysses inside groups of parallel.ulysses_degree ranks, rings across them (USP)",
        ),
        SequenceAxis(
            Placement.FILL,
            "every rank filled in node order to the mean modelled work: short sequences "
            "whole, long ones in unequal zigzag shares over consecutive ranks",
            ranks_apart=True,
        ),
    )
}

WEIGHTS_AXES: dict[WeightsMode, WeightsAxis] = {
    axis.mode: axis
    for axis in (
        WeightsAxis(
            WeightsMode.REPLICATED,
            "every rank holds all parameters and optimizer state; gradients all-reduced",
            Family.AUTOGRAD,
            Sharding.NONE,
        ),
        WeightsAxis(
            WeightsMode.FSDP,
            "torch FSDP2 over all ranks: parameters, gradients and optimizer state sharded",
            Family.AUTOGRAD,
            Sharding.ALL_RANKS,
        ),
        WeightsAxis(
            WeightsMode.HSDP,
            "torch FSDP2 sharded inside a node, replicated across nodes",
            Family.AUTOGRAD,
            Sharding.NODE,
        ),
        WeightsAxis(
            WeightsMode.TAWPIPE,
            "each rank owns a shard of layers that travels to the others: inside a node "
            "by broadcast, between nodes point to point (TawPipe)",
            Family.WEIGHT_PASSING,
            Sharding.OWNER,
            Passing.GROUPED,
        ),
        WeightsAxis(
            WeightsMode.RING_RELAY,
            "as tawpipe, but each shard and its gradient sum are relayed hop by hop around "
            "one ring of all ranks, every rank waiting out the hops (a lockstep ring "
            "baseline, not WeiPipe's staggered schedule)",
            Family.WEIGHT_PASSING,
            Sharding.OWNER,
            Passing.RING,
        ),
    )
}

RENAMED_WEIGHTS: dict[str, tuple[WeightsMode, str]] = {
    "weipipe": (
        WeightsMode.RING_RELAY,
        "it relays each shard and gradient sum around the ring hop by hop while every "
        "rank waits; it is not WeiPipe's staggered schedule, which only the simulator "
        "models, as the TawPipe paper's baseline in `ray-zep bench tawpipe`",
    ),
}
"""Former `parallel.weights` values: the mode each now is and why it was renamed. The
executor and its checkpoints are unchanged; only the name is."""


def declare_placement(value: str, summary: str, **traits: bool) -> SequenceAxis:
    """A new `parallel.sequence` value and its traits (`SequenceAxis` fields), for a
    placement that `ray_zep.partition.registry.register_placement` then registers
    (which adds it to `SEQUENCE_AXES`). The built-in values are the enum's own.

    Raises:
        ValueError: `value` is not a lower-case identifier.
    """
    if not value.isidentifier() or value != value.lower():
        raise ValueError(f"placement {value!r}: use a lower-case identifier")
    if value not in Placement._value2member_map_:
        _add_member(Placement, value.upper(), value)
    return SequenceAxis(Placement(value), summary, **traits)


def forget_placement(placement: Placement) -> None:
    """Undo `declare_placement` (and the registration's axis): for a placement that
    lives only as long as a plugin or a test needs it.

    Raises:
        ValueError: `placement` is built in.
    """
    if placement.value in BUILT_IN_PLACEMENTS:
        raise ValueError(f"placement {placement.value!r} is built in")
    SEQUENCE_AXES.pop(placement, None)
    Placement._member_map_.pop(placement.name, None)
    Placement._value2member_map_.pop(placement.value, None)
    if placement.name in Placement._member_names_:
        Placement._member_names_.remove(placement.name)
    if placement.name in Placement.__dict__:
        type.__delattr__(Placement, placement.name)


def _add_member(enum: type[Enum], name: str, value: str) -> None:
    """Add a member to an enum after its creation (what `Enum` itself does for each
    member it creates): lookups by value and name, iteration and pickling find it."""
    member = object.__new__(enum)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum
    enum._member_map_[name] = member
    enum._value2member_map_[value] = member
    enum._member_names_.append(name)
    type.__setattr__(enum, name, member)


def sequence_axis(placement: Placement) -> SequenceAxis:
    return SEQUENCE_AXES[placement]


def weights_axis(mode: WeightsMode) -> WeightsAxis:
    return WEIGHTS_AXES[mode]


@dataclass(frozen=True)
class AxesChoice:
    """The axis values of a run that decide whether they compose."""

    sequence: Placement
    weights: WeightsMode
    ep: int = 1
    moe_model: bool = False
    routing: bool = False
    remap: bool = False
    reference: Placement | None = None
    """The placement whose routing groups the one-process reference mirrors."""


def refusal(choice: AxesChoice) -> tuple[str, str] | None:
    """Why a combination of axis values cannot train, or None if it can.

    Returns:
        (config key to change, one-line reason), or None.
    """
    seq, weights = SEQUENCE_AXES[choice.sequence], WEIGHTS_AXES[choice.weights]
    if choice.reference is not None and not seq.one_process:
        return "parallel.reference_layout", (
            f"mirrors a distributed run's routing groups in the one-process reference; "
            f"it needs parallel.sequence={Placement.SINGLE.value}"
        )
    if choice.reference is not None and SEQUENCE_AXES[choice.reference].one_process:
        return "parallel.reference_layout", "must name a placement over several ranks"
    mirrored = SEQUENCE_AXES[choice.reference] if choice.reference is not None else seq
    if seq.one_process and choice.weights is not WeightsMode.REPLICATED:
        return "parallel.weights", (
            f"parallel.sequence={seq.name} trains the reference in one process with whole "
            "weights; use parallel.weights=replicated"
        )
    if seq.one_process and choice.ep > 1:
        return "parallel.ep", (
            f"expert parallelism needs several ranks; parallel.sequence={seq.name} runs one"
        )
    for key in ("routing", "remap"):
        if getattr(choice, key) and not (seq.planned or (seq.one_process and mirrored.planned)):
            return f"parallel.{key}", (
                f"moves the tokens of sequences that span ranks, and parallel.sequence="
                f"{seq.name} keeps every sequence on one rank; use a planned placement ("
                + ", ".join(a.name for a in SEQUENCE_AXES.values() if a.planned)
                + ")"
            )
    if weights.family is Family.WEIGHT_PASSING:
        if not seq.whole_sequences or seq.one_process:
            return "parallel.weights", (
                f"{weights.name} passes layer shards between ranks while each computes its "
                f"own whole sequences; parallel.sequence={seq.name} spreads sequences over "
                "ranks, whose attention would then wait on the transfers: use "
                f"parallel.sequence={Placement.WHOLE.value} or parallel.weights="
                f"{WeightsMode.FSDP.value}"
            )
        if choice.moe_model or choice.ep > 1:
            return "parallel.weights", (
                f"{weights.name} passes the layers of dense models; an MoE model's experts "
                f"stay on their expert-parallel ranks: use parallel.weights="
                f"{WeightsMode.FSDP.value} or {WeightsMode.REPLICATED.value}"
            )
    return None


def matrix_rows() -> list[tuple[str, str, str]]:
    """(sequence, weights, "trains" or the refusal) for every pair of a dense model."""
    rows = []
    for seq in SEQUENCE_AXES:
        for weights in WEIGHTS_AXES:
            why = refusal(AxesChoice(seq, weights))
            rows.append((seq.value, weights.value, "trains" if why is None else why[1]))
    return rows
