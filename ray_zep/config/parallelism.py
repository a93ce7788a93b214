"""How a run spreads over the hardware and talks over its links: the `parallel`,
`topology` and `comm` sections of the schema. Each checks its own keys in
`__post_init__`; whether the parallel axes compose is a rule across keys
(`ray_zep.config.checks`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_zep import constants
from ray_zep.config.rules import require
from ray_zep.options import (
    COMPRESSION_STREAMS,
    Compression,
    DkvWire,
    FsdpUnit,
    MoEPipeline,
    RemapPolicy,
    ZonePolicy,
)
from ray_zep.parallel.axes import SEQUENCE_AXES, WEIGHTS_AXES, Placement, WeightsMode

MAX_PREFETCH_DEPTH = 4
"""The most units `parallel.prefetch_depth` gathers ahead (each holds one more unit's
parameters)."""


@dataclass
class ParallelConfig:
    sequence: Placement = Placement.WHOLE
    """How a batch's tokens are placed over the ranks: single | whole | zeppelin | te_cp |
    llama_cp | hybrid_dp | ulysses | usp (ray_zep.parallel.axes)."""
    weights: WeightsMode = WeightsMode.REPLICATED
    """Where parameters, gradients and optimizer state live: replicated | fsdp | hsdp |
    tawpipe | ring_relay (ray_zep.parallel.axes)."""
    zone_policy: ZonePolicy = ZonePolicy.WORK
    """work | cost | capacity: how zeppelin places sequences: every rank's modelled work
    made equal (ray_zep.partition.balance; `whole` then deals its sequences by work too,
    ray_zep.partition.work_bins; the default: `bench scale` gives it the shorter modelled
    step in 14 of 16 cases at 64-4,096 GPUs), or zone thresholds by the cost model or by
    capacity alone (ray_zep.partition.zeppelin)."""
    usp_groups: bool = True
    """Under zone_policy=work, zeppelin may run a sequence longer than a node as a USP
    group (heads exchanged inside each node, the ring over the nodes) where that needs
    fewer ranks than a ring (ray_zep.partition.balance); false keeps rings only."""
    ring_kv_keep_gb: float | None = None
    """Under zone_policy=work, a zeppelin ring keeps the K/V its members receive in the
    forward for the backward, which then sends only the dK/dV accumulators (a quarter
    fewer ring bytes with float32 dK/dV), where a member keeps at most this many GB over
    all layers (the memory model counts them). Unset: what a rank holding
    train.tokens_per_rank tokens leaves of 90% of the GPU's memory, then ring by ring
    what each member's own tokens leave (ray_zep.partition.plan_memory); no limit on a
    topology without GPU memory; 0 sends K/V again in the backward."""
    ring_kv_room_mb: float | None = None
    """Under zone_policy=work, the MB of peers' K/V a zeppelin ring member may keep
    beyond ring_kv_keep_gb for each token it holds below train.tokens_per_rank: the
    planner keeps a ring's K/V where its members' own tokens leave that room, and fills
    them with that many fewer whole sequences. Unset: what a held token costs in the
    memory model, where ring_kv_keep_gb is unset too (ray_zep.partition.plan_memory);
    0 otherwise."""
    ulysses_degree: int = 0
    """Ulysses members per ring position under usp; 0 picks GPUs per node (or the
    largest divisor of it that the head counts allow)."""
    ulysses_chunks: int = 8
    """Pieces each USP group member's rows are split into for its head exchanges: the
    Q/K/V projection of a piece runs while the pieces before it travel, the output
    projection of a piece while the pieces after it arrive, and backward mirrors it
    (ray_zep.attention.ulysses_chunks; the planner's work model and the simulator count
    it). 1: each exchange whole, between the linear modules. The default: `bench scale`
    steps faster with 4 than whole on 24 of 32 rows of its 4k grid (sixty-fifth series);
    8 against 4 leaves that grid's mean as it was (20 of 32 rows faster, 7 slower, by up
    to 2.9%) and steps 0.5% faster at 16k tokens a GPU on 1,024 GPUs, where one-node USP
    positions send their ring K/V through the node's NICs (BENCHMARKS.md, seventy-fifth
    series). Blocks as FSDP units only
    (parallel.fsdp_unit=block), without parallel.remap, outside MoE blocks' pipelines and
    not under train.activation_checkpointing=linears; elsewhere exchanges run whole."""
    routing: bool = False
    """Send ring K/V (and dK/dV) between nodes through proxy ranks on every NIC
    (ray_zep.routing); planned placements only."""
    remap: bool = False
    """Run the linear modules (embedding, projections, norms, MLP, output) on a
    token-balanced layout and only attention on the plan's layout (ray_zep.remap);
    planned placements only."""
    remap_policy: RemapPolicy = RemapPolicy.WHEN_FASTER
    """when_faster | always: remap only the batches where it pays off, or every batch."""
    dkv_wire: DkvWire = DkvWire.OWNER
    """owner | float32 | compute: how ring dK/dV travel (ray_zep.options.DkvWire): float32
    accumulators; accumulators in the K/V dtype (half the bytes in bf16 runs, each hop's
    partial sum rounded); or each step's dK/dV straight to its owner in the K/V dtype,
    summed there in float32 (half the bytes, float32's sums; rings inside a node and
    Ulysses groups, float32 accumulators elsewhere)."""
    ep: int = 1
    """Expert-parallel degree: experts are split over groups of this many
    consecutive ranks; must divide the number of ranks and model.moe.num_experts."""
    moe_pipeline: MoEPipeline = MoEPipeline.NONE
    """none | moe_only | aaam | 1a1m: all-to-all overlap inside MoE blocks. aaam and
    1a1m slice attention under placements that keep every sequence on one rank
    (single, whole); under placements whose attention runs through the engine (zeppelin,
    te_cp, ...) the block overlaps only its MoE micro-batches, as moe_only does."""
    moe_overlap_degree: int = 4
    """d, micro-batches per MoE block under parallel.moe_pipeline."""
    moe_uniform_slicing: bool = True
    """Slice attention so every slice after the first costs the same (FoldMoE Alg. 1);
    false: d equal token slices. aaam and 1a1m only."""
    shard_recompute: bool = True
    """tawpipe | ring_relay: keep only each weight shard's input in forward and
    recompute its forward in backward (activation memory of one shard, 4/3 of the
    compute); false keeps every activation."""
    reference_layout: Placement | None = None
    """parallel.sequence=single only: route MoE tokens in the groups each rank of this
    placement holds (its linear layout; with parallel.remap, the remapped one), so that
    expert capacity drops exactly what that distributed run drops. Unset: the whole
    batch is one routing group, with a capacity sized for it."""
    reshard_after_forward: bool = True
    """fsdp | hsdp: free each block's gathered parameters after its forward and gather
    them again for backward (less memory, one more all-gather per block)."""
    shard_nodes: int = 0
    """fsdp: nodes one FSDP2 shard group spans, each group a replica of the others
    (torch's (replicate, shard) mesh: every block gathered and reduce-scattered inside
    its group, each reduced shard then all-reduced with its replicas, as hsdp does across
    nodes). A group's collectives wait on one ring step a member: over 1,024 GPUs of
    cluster A that latency alone is 4 ms a gather, over groups of 16 nodes 0.5 ms, each
    rank then keeping 1/128 of the optimizer state instead of 1/1,024. 0 = every node,
    one group; must divide topology.nodes (and every node count an elastic run may
    continue on); not with parallel.ep."""
    reshard_to_node: bool | None = None
    """fsdp over several nodes, resharding after forward: keep each unit's parameters
    sharded over its node's GPUs after its forward (FSDP2's reshard_after_forward=G), so
    that backward gathers them again inside the node, off the NICs that carry the rings'
    K/V and the gradients' reduce-scatter; each rank holds 1/G of every unit from its
    forward until its backward (a 7B model's blocks: 1.6 GB in bf16 on 8 GPUs a node).
    Unset: true where the topology names its GPU's memory and the memory model finds
    room for that at L tokens a rank, all in rings (ray_zep.partition.node_reshard)."""
    prefetch: bool = True
    """fsdp | hsdp: gather the next unit's parameters while the current one
    computes (explicit forward and backward prefetch)."""
    prefetch_after_attention: bool | None = None
    """fsdp | hsdp with prefetch, blocks as units: true: a block gathers the next unit's
    parameters once its attention has run, while its output projection and
    feed-forward compute, so that the gather and the ring's K/V do not share the
    NICs; false: when the block starts, as FSDP2's explicit prefetch
    does. Unset: whichever the cost model says exposes less
    (ray_zep.prefetch_plan)."""
    prefetch_depth: int | None = None
    """fsdp | hsdp with prefetch, blocks as units: how many units ahead a unit gathers
    (forward) and behind (backward). 2: a gather need not end before the next block but
    before the one after it, so what its ring steps' latency (4 ms over 1,024 GPUs of
    cluster A, 16 ms over 4,096) and the feed-forward leave over runs on into the next
    block, for one more block's parameters held (a 7B block: 0.4 GB in bf16). 1: the next
    unit only, FSDP2's own prefetch (ray_zep.train.fsdp, ray_zep.sim.weights). Unset: 2
    where a gather's ring steps take 2 ms or more and the block gathers after its
    attention, else 1 (ray_zep.prefetch_plan)."""
    fsdp_unit: FsdpUnit = FsdpUnit.BLOCK
    """fsdp | hsdp: block | linear, what one FSDP2 unit gathers: a transformer block,
    or each projection of a dense block apart (less memory, more collectives)."""

    def __post_init__(self) -> None:
        self._check_moe()
        require(
            self.ring_kv_keep_gb is None or self.ring_kv_keep_gb >= 0,
            "parallel.ring_kv_keep_gb",
            self.ring_kv_keep_gb,
            "must be >= 0 (0 = send K/V again in the backward)",
        )
        require(
            self.ring_kv_room_mb is None or self.ring_kv_room_mb >= 0,
            "parallel.ring_kv_room_mb",
            self.ring_kv_room_mb,
            "must be >= 0 (0 = ring_kv_keep_gb alone)",
        )
        require(
            self.prefetch_depth is None or 1 <= self.prefetch_depth <= MAX_PREFETCH_DEPTH,
            "parallel.prefetch_depth",
            self.prefetch_depth,
            f"must be 1 to {MAX_PREFETCH_DEPTH} (units gathered ahead)",
        )
        require(
            self.shard_nodes >= 0,
            "parallel.shard_nodes",
            self.shard_nodes,
            "must be >= 0 (0 = one shard group over every node)",
        )
        require(
            self.ulysses_degree >= 0,
            "parallel.ulysses_degree",
            self.ulysses_degree,
            "must be >= 0 (0 = automatic)",
        )
        require(
            self.ulysses_chunks >= 1,
            "parallel.ulysses_chunks",
            self.ulysses_chunks,
            "must be >= 1 (1 = each exchange whole)",
        )

    @property
    def ulysses_pieces(self) -> int:
        """The pieces USP head exchanges run in: `ulysses_chunks` where blocks are FSDP
        units (or weights are not sharded by FSDP), else 1."""
        return self.ulysses_chunks if self.fsdp_unit is FsdpUnit.BLOCK else 1

    @property
    def sequence_axis(self):
        return SEQUENCE_AXES[self.sequence]

    @property
    def weights_axis(self):
        return WEIGHTS_AXES[self.weights]

    def _check_moe(self) -> None:
        require(self.ep >= 1, "parallel.ep", self.ep, "must be >= 1")
        require(
            self.moe_overlap_degree >= 1,
            "parallel.moe_overlap_degree",
            self.moe_overlap_degree,
            "must be >= 1",
        )


@dataclass
class TopologyConfig:
    preset: str = "virtual"
    """virtual (sizes below) or a named cluster: cluster_a, cluster_b, cluster_c, or a
    paper's testbed: foldmoe_a10g, tawpipe_a100."""
    nodes: int = 1
    """Number of nodes."""
    gpus_per_node: int | None = None
    """GPUs per node; presets fix it (8), virtual defaults to 1."""
    nics_per_node: int | None = None
    """Inter-node NICs per node; defaults to the preset's, or one per GPU."""
    intra_node_gbytes_per_s: float | None = None
    """Per-GPU intra-node bandwidth, GB/s each way."""
    nic_gbits_per_s: float | None = None
    """Per-NIC inter-node bandwidth, Gb/s each way."""
    intra_node_latency_us: float | None = None
    inter_node_latency_us: float | None = None
    gpu_memory_gb: float | None = None
    """Memory of one GPU, GB (1e9 bytes); defaults to the preset's (unknown on virtual)."""

    def __post_init__(self) -> None:
        require(self.nodes >= 1, "topology.nodes", self.nodes, "must be >= 1")
        require(
            self.gpu_memory_gb is None or self.gpu_memory_gb > 0,
            "topology.gpu_memory_gb",
            self.gpu_memory_gb,
            "must be > 0",
        )
        for key in ("gpus_per_node", "nics_per_node"):
            value = getattr(self, key)
            require(value is None or value >= 1, f"topology.{key}", value, "must be >= 1")
        for key in ("intra_node_gbytes_per_s", "nic_gbits_per_s"):
            value = getattr(self, key)
            require(value is None or value > 0, f"topology.{key}", value, "must be > 0")
        for key in ("intra_node_latency_us", "inter_node_latency_us"):
            value = getattr(self, key)
            require(value is None or value >= 0, f"topology.{key}", value, "must be >= 0")


@dataclass
class CommConfig:
    init_timeout_s: float = constants.DEFAULT_INIT_TIMEOUT_S
    """Rendezvous and worker-group start."""
    timeout_s: float = constants.DEFAULT_COLLECTIVE_TIMEOUT_S
    """Every collective and every shard fetch in steady state."""
    compression: Compression = Compression.OFF
    """Lossless compression of communication (off, auto, always). Streams that move
    bytes stay bit-identical; zipped sums are taken in float32 in rank order, so
    they may differ from the backend's in the last bits."""
    compression_streams: list[str] = field(default_factory=lambda: list(COMPRESSION_STREAMS))
    """What may travel compressed (`ray_zep.options.CompressionStream` says what each
    stream carries and whether it is bit-identical)."""
    compression_refresh_calls: int = 32
    """With `auto`: every how many calls a stream goes zipped to measure its ratio."""

    def __post_init__(self) -> None:
        for key in ("init_timeout_s", "timeout_s"):
            value = getattr(self, key)
            require(value > 0, f"comm.{key}", value, "must be > 0")
        unknown = sorted(set(self.compression_streams) - set(COMPRESSION_STREAMS))
        require(
            not unknown,
            "comm.compression_streams",
            self.compression_streams,
            f"unknown {unknown}; allowed: {', '.join(COMPRESSION_STREAMS)}",
        )
        require(
            self.compression_refresh_calls >= 1,
            "comm.compression_refresh_calls",
            self.compression_refresh_calls,
            "must be >= 1",
        )
