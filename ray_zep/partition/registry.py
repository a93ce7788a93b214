"""Every placement's spec, in one table: what the package lists, plans and simulates.

The planners' entry point (`ray_zep.partition.make_plan`), the simulator's variants
(`ray_zep.sim.compare`), the benches' default lists and the config's choices of
`parallel.sequence` read this table; none of them lists placements of its own.

Adding a placement is one module (its planner, its layout if it cuts sequences in a
new way, and its `PlacementSpec`) and one line in `BUILT_IN` below; a placement that
lives outside the package (a plugin, a test) calls `register_placement` instead:

    axis = declare_placement("my_ring", "one line for the docs")
    register_placement(PlacementSpec(axis, my_planner, layouts=(MY_LAYOUT,), ...))
"""

from __future__ import annotations

from ray_zep.errors import PlacementError
from ray_zep.parallel.axes import SEQUENCE_AXES, Placement, forget_placement
from ray_zep.partition import baselines, fill_ring, zeppelin
from ray_zep.partition.layout import register_layout
from ray_zep.partition.spec import Bench, PlacementSpec, Role, Variant, listed_in

SPECS: dict[Placement, PlacementSpec] = {}
"""Every registered placement's spec, in registration order."""


def register_placement(spec: PlacementSpec) -> PlacementSpec:
    """Add `spec` (its axis to `SEQUENCE_AXES`, its layouts to the layouts).

    Raises:
        PlacementError: its placement, one of its variant names or its role is taken,
            or a planner where its traits say whole sequences (or none where they do not).
    """
    known = SPECS.get(spec.axis.placement)
    if known is not None:
        if known == spec:
            return known
        raise PlacementError(f"placement {spec.name!r} is registered already")
    if (spec.planner is None) != spec.axis.whole_sequences:
        raise PlacementError(
            f"placement {spec.name!r}: a planner places sequences over ranks; whole-sequence "
            "placements have none (their batches are packed in bins)"
        )
    taken = set(variants()) & set(spec.simulated())
    if taken:
        raise PlacementError(f"placement {spec.name!r}: variant names {sorted(taken)} are taken")
    if spec.role is not None and any(s.role is spec.role for s in SPECS.values()):
        holder = playing(spec.role).name
        raise PlacementError(f"placement {spec.name!r}: {holder} plays {spec.role.value}")
    for layout in spec.layouts:
        register_layout(layout)
    SEQUENCE_AXES[spec.axis.placement] = spec.axis
    SPECS[spec.axis.placement] = spec
    return spec


def unregister_placement(placement: Placement) -> None:
    """Remove a placement registered from outside the package, and its value.

    Raises:
        ValueError: `placement` is built in.
    """
    forget_placement(placement)
    SPECS.pop(placement, None)


def spec_of(placement: Placement) -> PlacementSpec:
    """The spec of `placement`.

    Raises:
        PlacementError: it has none.
    """
    if placement not in SPECS:
        raise PlacementError(f"placement {placement.value!r} is not registered")
    return SPECS[placement]


def planned() -> tuple[Placement, ...]:
    """Placements whose planner computes the placement from the lengths alone."""
    return tuple(p for p, spec in SPECS.items() if spec.planner is not None)


def variants() -> dict[str, Variant]:
    """`ray-zep simulate`'s variants of every placement, by name."""
    return {name: v for spec in SPECS.values() for name, v in spec.simulated().items()}


def listed(bench: Bench) -> tuple[str, ...]:
    """The names `bench` lists by default, in registration order."""
    return tuple(name for spec in SPECS.values() for name in spec.names_in(bench))


def playing(role: Role) -> PlacementSpec:
    """The placement that plays `role`."""
    return next(spec for spec in SPECS.values() if spec.role is role)


def reference() -> PlacementSpec:
    """The placement every comparison is relative to."""
    return playing(Role.REFERENCE)


SINGLE = PlacementSpec(SEQUENCE_AXES[Placement.SINGLE])
WHOLE = PlacementSpec(
    SEQUENCE_AXES[Placement.WHOLE],
    listed=listed_in(Bench.VALIDATE, Bench.VALIDATE_QUICK),
    role=Role.PACKED,
)

BUILT_IN = (
    SINGLE,
    WHOLE,
    zeppelin.SPEC,
    baselines.TE_CP,
    baselines.LLAMA_CP,
    baselines.HYBRID_DP,
    baselines.ULYSSES,
    baselines.USP,
    fill_ring.SPEC,
)
for _spec in BUILT_IN:
    register_placement(_spec)
