"""The modelled per-rank memory of a plan, against the GPU it must fit.

`ray-zep plan` prints it, `plan --auto` drops the compositions that do not fit, and
`bench scale` reports the fullest rank: the memory model of `ray_zep.parallel.memory`
applied to each rank's tokens under a plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ray_zep.config import Config, ParallelConfig
from ray_zep.errors import MemoryPlanError
from ray_zep.model_shapes import ModelShape
from ray_zep.options import ZonePolicy
from ray_zep.parallel.axes import Placement, WeightsMode
from ray_zep.parallel.memory import GB, RankMemory, model_memory
from ray_zep.partition import make_plan
from ray_zep.partition.exchange import Exchange
from ray_zep.partition.node_reshard import reshards_to_node, with_node_shards
from ray_zep.partition.plan import AttentionPlan, Zone, peer_tokens
from ray_zep.partition.stats import PlanStats, kept_kv_tokens
from ray_zep.run_memory import memory_inputs, memory_precision
from ray_zep.topology import Topology


@dataclasses.dataclass(frozen=True)
class PlanMemory:
    """The modelled per-rank memory of a plan, and the GPU it must fit."""

    ranks: list[RankMemory]
    tokens: list[int]
    gpu_bytes: float
    gpu_model: str
    how: str
    """Compute dtype and kernel the model assumed."""
    weights: str
    alternative: tuple[str, RankMemory] | None = None
    """Another weights mode's figure for the fullest rank, when this one does not fit."""

    @property
    def fullest(self) -> int:
        return max(range(len(self.ranks)), key=lambda r: self.ranks[r].total)

    @property
    def fits(self) -> bool:
        return not self.gpu_bytes or self.ranks[self.fullest].total <= self.gpu_bytes

    def table(self) -> str:
        r = self.fullest
        gpu = f"{self.gpu_bytes / GB:.0f} GB ({self.gpu_model})" if self.gpu_bytes else "unknown"
        return (
            f"per-rank memory, modelled ({self.how}), parallel.weights={self.weights}: "
            f"fullest rank {r} ({self.tokens[r]} tokens) {self.ranks[r].describe()}; "
            f"GPU memory {gpu}: {'fits' if self.fits else 'DOES NOT FIT'}"
        )

    def check(self) -> None:
        """Raises MemoryPlanError naming the figure and the axis to change."""
        if self.fits:
            return
        r = self.fullest
        advice = (
            "set parallel.weights=fsdp or hsdp, train.activation_checkpointing=full, or "
            "lower train.tokens_per_rank"
        )
        if self.alternative is not None:
            name, other = self.alternative
            fits = "fits" if other.total <= self.gpu_bytes else "does not fit either"
            advice = f"parallel.weights={name} models {other.total / GB:.1f} GB ({fits}); " + advice
        raise MemoryPlanError(
            f"per-rank memory {self.ranks[r].total / GB:.1f} GB (rank {r}, {self.tokens[r]} "
            f"tokens, parallel.weights={self.weights}) exceeds the {self.gpu_bytes / GB:.0f} GB "
            f"of one {self.gpu_model}: {advice}"
        )


KEEP_SHARE = 0.9
"""Share of the GPU's memory that an unset `parallel.ring_kv_keep_gb` lets kept ring K/V
fill, beside the rest of a rank's peak (the remainder: the allocator's slack)."""


def rank_memory(
    config: Config,
    topology: Topology,
    shape: ModelShape,
    tokens: int,
    ring_tokens: int = 0,
    kept_kv_tokens: float = 0.0,
) -> RankMemory:
    """The modelled peak of a rank holding `tokens` (`ring_tokens` of them in rings,
    `kept_kv_tokens` of its peers' K/V kept: `MemoryInputs`), with the node's shards where
    the run keeps them (`parallel.reshard_to_node` as `reshards_to_node` resolves it)."""
    if config.parallel.reshard_to_node is None:
        config = with_node_shards(config, reshards_to_node(config, topology, shape))
    dtype, flash, _ = memory_precision(config, topology)
    on_cpu = topology.gpu_memory_bytes <= 0
    inputs = memory_inputs(config, topology, tokens, ring_tokens, dtype, flash, on_cpu,
                           kept_kv_tokens)  # fmt: skip
    return model_memory(shape, inputs)


@dataclasses.dataclass(frozen=True)
class TokenMemory:
    """The memory model's peak of a rank as what it holds makes it, between none and L
    tokens of each: a fixed part, and bytes per token held, per held token in a ring and
    per token of its peers' K/V kept. The ring K/V budget (`ring_kv_keep_gb`), the room
    a token frees (`ring_kv_room_mb`) and `keep_where_room` read the same figures."""

    base: float
    per_token: float
    per_ring: float
    per_kept: float
    capacity: int

    @classmethod
    def of(cls, config: Config, topology: Topology, shape: ModelShape) -> TokenMemory:
        capacity = config.train.tokens_per_rank
        base = rank_memory(config, topology, shape, 0).total
        full = rank_memory(config, topology, shape, capacity).total
        ring = rank_memory(config, topology, shape, capacity, capacity).total
        kept = rank_memory(config, topology, shape, capacity, 0, capacity).total
        return cls(base, (full - base) / capacity, (ring - full) / capacity,
                   (kept - full) / capacity, capacity)  # fmt: skip

    @property
    def ring_peak(self) -> float:
        """The peak of a rank holding L tokens, all in rings, keeping none."""
        return self.base + (self.per_token + self.per_ring) * self.capacity


def ring_kv_keep_gb(
    config: Config, topology: Topology, shape: ModelShape, memory: TokenMemory | None = None
) -> float:
    """`parallel.ring_kv_keep_gb`, or where it is unset what a rank holding L tokens, all
    in rings, leaves of `KEEP_SHARE` of the GPU's memory (no limit on a topology with no
    GPU memory, as a virtual CPU one). `memory`: the model's figures, if worked out."""
    if config.parallel.ring_kv_keep_gb is not None:
        return float(config.parallel.ring_kv_keep_gb)
    if topology.gpu_memory_bytes <= 0:
        return float("inf")
    memory = memory or TokenMemory.of(config, topology, shape)
    return max(0.0, KEEP_SHARE * topology.gpu_memory_bytes - memory.ring_peak) / 1e9


def ring_kv_room_mb(
    config: Config, topology: Topology, shape: ModelShape, memory: TokenMemory | None = None
) -> float:
    """`parallel.ring_kv_room_mb`, or where it and `parallel.ring_kv_keep_gb` are unset
    what one token held in a ring costs in the memory model (MB), on a GPU of known
    memory; 0 otherwise."""
    parallel = config.parallel
    if parallel.ring_kv_room_mb is not None:
        return float(parallel.ring_kv_room_mb)
    if parallel.ring_kv_keep_gb is not None or topology.gpu_memory_bytes <= 0:
        return 0.0
    memory = memory or TokenMemory.of(config, topology, shape)
    return max(0.0, memory.per_token + memory.per_ring) / 1e6


def planning_parallel(
    config: Config, topology: Topology, shape: ModelShape, memory: TokenMemory | None = None
) -> ParallelConfig:
    """`config.parallel` with the ring K/V budget resolved (`ring_kv_keep_gb`,
    `ring_kv_room_mb`), as the planners take it."""
    return dataclasses.replace(
        config.parallel,
        ring_kv_keep_gb=ring_kv_keep_gb(config, topology, shape, memory),
        ring_kv_room_mb=ring_kv_room_mb(config, topology, shape, memory),
    )


def memory_plan(
    placement: Placement,
    lengths: np.ndarray,
    config: Config,
    topology: Topology,
    shape: ModelShape,
) -> AttentionPlan:
    """The plan of `placement` for `lengths` as a run of `config` makes it: the planner
    under `planning_parallel`, then `keep_where_room`."""
    memory = None
    if config.parallel.ring_kv_keep_gb is None and topology.gpu_memory_bytes > 0:
        memory = TokenMemory.of(config, topology, shape)
    parallel = planning_parallel(config, topology, shape, memory)
    plan = make_plan(placement, lengths, topology, config.train.tokens_per_rank, shape, parallel)
    return keep_where_room(plan, config, topology, shape, memory)


def keep_where_room(
    plan: AttentionPlan,
    config: Config,
    topology: Topology,
    shape: ModelShape,
    memory: TokenMemory | None = None,
) -> AttentionPlan:
    """`plan` with more of zeppelin's rings keeping their K/V (`Exchange.RING_KEPT`).

    Under an unset `parallel.ring_kv_keep_gb` the planner keeps a ring's K/V where a rank
    of L tokens would have room for them; the members of a long sequence's ring hold
    far fewer tokens and have room for more. Here every ring not yet kept, most tokens
    first, keeps its K/V where each member's modelled memory (its tokens, its ring
    tokens and all the K/V it keeps, at the memory model's rates between none and L)
    stays within `KEEP_SHARE` of the GPU's; first, where those rates put a member past
    that share, rings the planner kept there send their K/V again (`_sent_again`). A
    set budget, a GPU of unknown memory, or another placement or policy leaves the plan
    as it is. `memory`: the model's figures, if worked out."""
    parallel = config.parallel
    if (
        parallel.ring_kv_keep_gb is not None
        or topology.gpu_memory_bytes <= 0
        or plan.planner is not Placement.ZEPPELIN
        or parallel.zone_policy is not ZonePolicy.WORK
    ):
        return plan
    split = [item for item in plan.items() if item.ring_size > 1]
    if not split:
        return plan
    memory = memory or TokenMemory.of(config, topology, shape)
    ring = np.zeros(plan.world)
    members, kept_rings = [], []  # (item, its ranks, its tokens, each member's peers' tokens)
    for item in split:
        positions = np.asarray(plan.position_tokens(item), dtype=np.float64)
        ranks = np.asarray(item.ranks)
        ring[ranks] += np.repeat(positions, item.ulysses) / item.ulysses
        entry = (item, ranks, float(positions.sum()), peer_tokens(positions, item.ulysses))
        if item.exchange is Exchange.RING:
            members.append(entry)
        elif item.exchange is Exchange.RING_KEPT:
            kept_rings.append(entry)
    kept = kept_kv_tokens(plan)
    used = (memory.base + memory.per_token * plan.rank_tokens() + memory.per_ring * ring
            + memory.per_kept * kept)  # fmt: skip
    room = KEEP_SHARE * topology.gpu_memory_bytes - used
    sent = _sent_again(kept_rings, room, memory.per_kept)
    keep = set()
    for item, ranks, _, others in sorted(members, key=lambda m: -m[2]):
        cost = memory.per_kept * others
        if np.all(cost <= room[ranks]):
            room[ranks] -= cost
            keep.update(item.seqs)
    if sent:
        plan = plan.with_exchange(sent, Exchange.RING)
    if keep:
        plan = plan.with_exchange(keep, Exchange.RING_KEPT)
    return plan


def _sent_again(kept_rings: list, room: np.ndarray, per_kept: float) -> set[int]:
    """The sequences of kept rings that send their K/V again so that no member is past
    the share (`room` below 0, updated): the planner keeps by each ring's own room as it
    places, and a member may keep the K/V of a second ring besides. On each member past
    it, the kept ring of least K/V there that brings it back, else the one of most, until
    it is back or keeps none."""
    sent: set[int] = set()
    over = room < 0
    on_rank: dict[int, list[tuple[float, int]]] = {}  # member past it -> (K/V, ring)
    for at, (_, ranks, _, others) in enumerate(kept_rings):
        for member in np.flatnonzero(over[ranks]):
            on_rank.setdefault(int(ranks[member]), []).append((per_kept * others[member], at))
    dropped: set[int] = set()
    for rank, here in sorted(on_rank.items()):
        here = [h for h in here if h[1] not in dropped]
        while room[rank] < 0 and here:
            enough = [h for h in here if h[0] >= -room[rank]]
            pick = min(enough) if enough else max(here)
            here.remove(pick)
            item, ranks, _, others = kept_rings[pick[1]]
            room[ranks] += per_kept * others
            sent.update(item.seqs)
            dropped.add(pick[1])
    return sent


def plan_memory(
    config: Config, topology: Topology, stats: PlanStats, shape: ModelShape
) -> PlanMemory:
    """Every rank's modelled memory for the plan's tokens (GPU presets: bf16, flash-attn;
    the node's shards of every block where the run keeps them, said in `how`)."""
    _, _, how = memory_precision(config, topology)
    if reshards_to_node(config, topology, shape):
        how += ", each block's node shard kept from forward to backward (parallel.reshard_to_node)"
    tokens = [int(t) for t in stats.tokens]

    def ranks_of(cfg: Config) -> list[RankMemory]:
        out = []
        modelled: dict[tuple, RankMemory] = {}  # the ranks of a ring hold alike
        for rank, held in enumerate(tokens):
            ring = sum(n for zone, n in stats.zones[rank].items() if zone != Zone.LOCAL.value)
            key = (held, ring, float(stats.kept_kv_tokens[rank]))
            if key not in modelled:
                modelled[key] = rank_memory(cfg, topology, shape, *key)
            out.append(modelled[key])
        return out

    weights = config.parallel.weights
    memory = PlanMemory(ranks_of(config), tokens, topology.gpu_memory_bytes,
                        topology.gpu_model, how, weights.value)  # fmt: skip
    if memory.fits or weights is WeightsMode.FSDP:
        return memory
    parallel = dataclasses.replace(config.parallel, weights=WeightsMode.FSDP)
    other = ranks_of(dataclasses.replace(config, parallel=parallel))
    alternative = (WeightsMode.FSDP.value, other[memory.fullest])
    return dataclasses.replace(memory, alternative=alternative)
