"""What a user may change in every case of `ray-zep bench scale` and `bench scale-replay`:
`key=value` overrides, as `ray-zep train` takes them (`comm.compression=auto`,
`parallel.weights=hsdp`, `topology.nic_gbits_per_s=400`, ...), on top of the grid's own
config of each case; and the keys the grid sets itself, which an override may not.

A record keeps its overrides in its spec, and `scale-replay` plays them again before any
it is given, so that a replay of the same code steps as the record did and a replay with
one more override shows what that key is worth on the grid's rows."""

from __future__ import annotations

from collections.abc import Sequence

from ray_zep.config import Config, load_config
from ray_zep.errors import ConfigError, TopologyError
from ray_zep.parallel.axes import WEIGHTS_AXES, Family
from ray_zep.topology import build_topology

GPUS_PER_NODE = 8
"""Cluster A's nodes (`topology.preset=cluster_a`)."""

_CHECKPOINTING = "each row takes the lightest activation checkpointing that fits the GPU"
GRID_KEYS: dict[str, str] = {
    "topology.preset": "the grid runs on cluster A",
    "topology.nodes": "--gpus",
    "topology.gpus_per_node": f"--gpus, {GPUS_PER_NODE} a node",
    "train.tokens_per_rank": "--headroom and --room",
    "train.micro_batches": "--micro-batches",
    "train.activation_checkpointing": _CHECKPOINTING,
    "train.checkpoint_blocks": _CHECKPOINTING,
    "train.checkpoint_rest": _CHECKPOINTING,
    "parallel.ring_kv_room_mb": "--kv-room",
    "parallel.sequence": "--placements",
    "parallel.routing": "--placements",
    "parallel.remap": "--placements",
}
"""Keys the grid sets in each case, and what sets them instead."""
GRID_SECTIONS: dict[str, str] = {
    "model": "--models",
    "data": "--distributions and --tokens: the grid draws its own batches, each packed by its "
    "own fill",
}
"""Sections the grid sets whole."""


def case_overrides(
    gpus: int, model: str, capacity: int, kv_room: float | None, overrides: Sequence[str]
) -> list[str]:
    """The config of one case: cluster A with `gpus` GPUs, the `model` preset, L =
    `capacity`, FSDP (unless `overrides` name another weights mode), the user's
    `overrides`, and the K/V room the row tries (None: the memory model's)."""
    room = [] if kv_room is None else [f"parallel.ring_kv_room_mb={kv_room}"]
    return ["topology.preset=cluster_a", f"topology.nodes={gpus // GPUS_PER_NODE}",
            f"model.preset={model}", f"train.tokens_per_rank={capacity}",
            "parallel.weights=fsdp", *overrides, *room]  # fmt: skip


def checked_overrides(command: str, overrides: Sequence[str]) -> tuple[str, ...]:
    """`overrides` once each is known to apply to every case.

    Raises:
        ConfigError: naming `command` and the override, where it sets a key the grid sets
            (and what sets it), names no key, has a value the key does not take (cluster
            A's fixed sizes included), or names a weights mode the grid does not play.
    """
    if not overrides:  # the grid's own config: nothing to load (every spec checks it)
        return ()
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        owner = GRID_KEYS.get(key) or GRID_SECTIONS.get(key.split(".", 1)[0])
        if owner is not None:
            raise ConfigError(f"{command} override {item!r}: the grid sets {key} ({owner})")
    try:
        config: Config = load_config(None, case_overrides(64, "7b", 5120, None, overrides))
        build_topology(config.topology)
    except (ConfigError, TopologyError) as exc:
        raise ConfigError(f"{command} overrides: {exc}") from None
    weights = config.parallel.weights
    if WEIGHTS_AXES[weights].family is not Family.AUTOGRAD:
        autograd = ", ".join(m.value for m, axis in WEIGHTS_AXES.items()
                             if axis.family is Family.AUTOGRAD)  # fmt: skip
        raise ConfigError(f"{command} override parallel.weights={weights.value}: the grid plays "
                          f"the modes autograd trains ({autograd}); `ray-zep bench tawpipe` "
                          "plays weight passing")  # fmt: skip
    return tuple(overrides)


OVERRIDES_HELP = (
    "(e.g. comm.compression=auto, parallel.weights=hsdp, topology.nic_gbits_per_s=400); not "
    "the keys the grid sets: model.*, topology.preset/nodes/gpus_per_node, "
    "train.tokens_per_rank/micro_batches and checkpointing, "
    "parallel.sequence/routing/remap/ring_kv_room_mb, data.*"
)
"""What an override may set, for the commands' help."""


def overrides_note(overrides: Sequence[str]) -> list[str]:
    """The line a table with `overrides` prints above it (none without)."""
    return [f"every case under: {' '.join(overrides)}"] if overrides else []
