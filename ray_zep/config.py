"""Run configuration: typed dataclasses are the schema.

Values come from a YAML file and CLI dotlist overrides (`train.steps=5`), merged
over the dataclass defaults with omegaconf in struct mode, so an unknown key or a
value of the wrong type is an error that names the key. Each dataclass checks its
own ranges in `__post_init__`; `Config.__post_init__` checks rules that span
sections.

Public contract (other tools and users rely on these keys): `train.steps`,
`train.seed`, `train.out_dir`, `train.tokens_per_rank`, `parallel.sequence`,
`parallel.weights`, `topology.preset`, `topology.nodes`, `topology.gpus_per_node`,
`model.preset`, `data.source`. Whether the parallel axes compose is decided by
`ray_zep.parallel.axes.refusal` when the config loads.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from ray_zep import constants
from ray_zep.errors import ConfigError
from ray_zep.model_shapes import build_shape
from ray_zep.options import (  # the enums are part of the schema: re-exported
    COMPRESSION_STREAMS as COMPRESSION_STREAMS,
)
from ray_zep.options import (
    ActivationCheckpointing as ActivationCheckpointing,
)
from ray_zep.options import (
    Compression as Compression,
)
from ray_zep.options import (
    Device as Device,
)
from ray_zep.options import (
    FsdpUnit as FsdpUnit,
)
from ray_zep.options import (
    MoEDispatch as MoEDispatch,
)
from ray_zep.options import (
    MoEPipeline as MoEPipeline,
)
from ray_zep.options import (
    Overlong as Overlong,
)
from ray_zep.options import (
    Packing as Packing,
)
from ray_zep.options import (
    Precision as Precision,
)
from ray_zep.options import (
    RemapPolicy as RemapPolicy,
)
from ray_zep.options import (
    ResumeMode as ResumeMode,
)
from ray_zep.options import (
    ZonePolicy as ZonePolicy,
)
from ray_zep.parallel.axes import (
    RENAMED_WEIGHTS,
    SEQUENCE_AXES,
    WEIGHTS_AXES,
    AxesChoice,
    Placement,
    WeightsMode,
    refusal,
)

log = logging.getLogger(__name__)


def _require(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"config key {key}={value!r}: {rule}")


@dataclass
class TrainConfig:
    steps: int = 100
    """Number of optimizer steps of the whole run (a resumed run continues up to it)."""
    seed: int = 0
    """Seeds model initialisation and data order."""
    out_dir: str = "runs/demo"
    """Run directory: resolved config, metrics.jsonl, checkpoints. Shared by all nodes."""
    tokens_per_rank: int = 1024
    """L, the token capacity of one GPU per step; a global batch holds nodes x GPUs x L."""
    micro_batches: int = 1
    """Global batches per optimizer step (gradient accumulation): a step trains on k
    consecutive batches of the stream, one after the other, and updates once with the
    gradient of the mean token loss over all of them (as one process training on their
    union would). k > 1 keeps one more copy of the gradients."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr x min_lr_ratio on the last step."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    checkpoint_every: int = 0
    """Save a checkpoint every k steps; 0 saves only at the end of the run."""
    save_last: bool = True
    """Save a checkpoint after the last step. False: a throwaway run (a smoke test, a
    timing) ends without one; `checkpoint_every` and `eval_every` still save theirs."""
    keep_checkpoints: int = 0
    """Complete checkpoints kept: after each save, older ones beyond the newest k are
    deleted (with interrupted saves older than the newest); 0 keeps every one."""
    resume: ResumeMode = ResumeMode.AUTO
    sample_ledger: bool = True
    """Every rank records the document pieces it trains on, step by step, in
    `<out_dir>/samples/` (see ray_zep.train.ledger)."""
    device: Device = Device.AUTO
    precision: Precision = Precision.AUTO
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.NONE
    """Per transformer block: `full` recomputes the block in backward, `selective` its
    feed-forward part only (attention outputs kept); results equal `none`."""
    eval_every: int = 0
    """Every k steps, the validation loss on `data.eval_source` (a checkpoint is saved
    at those steps; rank 0 evaluates it as `ray-zep eval` does); 0: never."""
    eval_batches: int = 8
    """Batches of `data.eval_source` each evaluation reads (the same ones every time);
    0 reads it all once."""

    def __post_init__(self) -> None:
        _require(self.steps >= 1, "train.steps", self.steps, "must be >= 1")
        _require(self.micro_batches >= 1, "train.micro_batches", self.micro_batches, "must be >= 1")
        _require(self.eval_every >= 0, "train.eval_every", self.eval_every, "must be >= 0")
        _require(self.eval_batches >= 0, "train.eval_batches", self.eval_batches, "must be >= 0")
        _require(
            self.tokens_per_rank >= 2, "train.tokens_per_rank", self.tokens_per_rank, "must be >= 2"
        )
        _require(self.lr > 0, "train.lr", self.lr, "must be > 0")
        _require(
            0 <= self.min_lr_ratio <= 1,
            "train.min_lr_ratio",
            self.min_lr_ratio,
            "must be in [0, 1]",
        )
        _require(self.warmup_steps >= 0, "train.warmup_steps", self.warmup_steps, "must be >= 0")
        _require(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0")
        for key in ("adam_beta1", "adam_beta2"):
            value = getattr(self, key)
            _require(0 <= value < 1, f"train.{key}", value, "must be in [0, 1)")
        _require(self.adam_eps > 0, "train.adam_eps", self.adam_eps, "must be > 0")
        _require(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "must be >= 0")
        _require(
            self.checkpoint_every >= 0,
            "train.checkpoint_every",
            self.checkpoint_every,
            "must be >= 0",
        )
        _require(bool(self.out_dir), "train.out_dir", self.out_dir, "must not be empty")
        _require(
            self.keep_checkpoints >= 0,
            "train.keep_checkpoints",
            self.keep_checkpoints,
            "must be >= 0 (0 keeps every checkpoint)",
        )


@dataclass
class ParallelConfig:
    sequence: Placement = Placement.WHOLE
    """How a batch's tokens are placed over the ranks: single | whole | zeppelin | te_cp |
    llama_cp | hybrid_dp | ulysses | usp (ray_zep.parallel.axes)."""
    weights: WeightsMode = WeightsMode.REPLICATED
    """Where parameters, gradients and optimizer state live: replicated | fsdp | hsdp |
    tawpipe | ring_relay (ray_zep.parallel.axes)."""
    zone_policy: ZonePolicy = ZonePolicy.COST
    """cost | capacity | work: how zeppelin places sequences: zone thresholds by the cost
    model or by capacity alone (ray_zep.partition.zeppelin), or every rank's modelled
    work made equal (ray_zep.partition.balance; `whole` then deals its sequences by
    work too, ray_zep.partition.work_bins)."""
    ulysses_degree: int = 0
    """Ulysses members per ring position under usp; 0 picks GPUs per node (or the
    largest divisor of it that the head counts allow)."""
    routing: bool = False
    """Send ring K/V (and dK/dV) between nodes through proxy ranks on every NIC
    (ray_zep.routing); planned placements only."""
    remap: bool = False
    """Run the linear modules (embedding, projections, norms, MLP, output) on a
    token-balanced layout and only attention on the plan's layout (ray_zep.remap);
    planned placements only."""
    remap_policy: RemapPolicy = RemapPolicy.WHEN_FASTER
    """when_faster | always: remap only the batches where it pays off, or every batch."""
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
    prefetch: bool = True
    """fsdp | hsdp: gather the next unit's parameters while the current one
    computes (explicit forward and backward prefetch)."""
    fsdp_unit: FsdpUnit = FsdpUnit.BLOCK
    """fsdp | hsdp: block | linear, what one FSDP2 unit gathers: a transformer block,
    or each projection of a dense block apart (less memory, more collectives)."""

    def __post_init__(self) -> None:
        self._check_moe()
        _require(
            self.ulysses_degree >= 0,
            "parallel.ulysses_degree",
            self.ulysses_degree,
            "must be >= 0 (0 = automatic)",
        )

    @property
    def sequence_axis(self):
        return SEQUENCE_AXES[self.sequence]

    @property
    def weights_axis(self):
        return WEIGHTS_AXES[self.weights]

    def _check_moe(self) -> None:
        _require(self.ep >= 1, "parallel.ep", self.ep, "must be >= 1")
        _require(
            self.moe_overlap_degree >= 1,
            "parallel.moe_overlap_degree",
            self.moe_overlap_degree,
            "must be >= 1",
        )


@dataclass
class MoEConfig:
    num_experts: int | None = None
    """Experts per MoE block; 0 = dense. Unset: the model preset's."""
    top_k: int | None = None
    """Experts per token, 1 or 2 (preset)."""
    capacity_factor: float | None = None
    """Expert slots = ceil(CF · top_k · tokens / experts) per rank; <= 0: dropless (preset)."""
    hidden_dim: int | None = None
    """Each expert's SwiGLU inner dimension; 0 = model.ffn_dim (preset)."""
    every: int | None = None
    """Every n-th block is an MoE block (preset)."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (GShard's, over the whole global batch)."""
    dispatch: MoEDispatch = MoEDispatch.AUTO
    """auto | padded | varlen: how tokens reach the experts (see MoEDispatch)."""

    def __post_init__(self) -> None:
        _require(self.aux_loss_coef >= 0, "model.moe.aux_loss_coef", self.aux_loss_coef, ">= 0")

    def overrides(self) -> dict[str, Any]:
        """The MoE fields of the model shape that are set explicitly, by shape name."""
        names = {
            "num_experts": "moe_experts",
            "top_k": "moe_top_k",
            "capacity_factor": "moe_capacity_factor",
            "hidden_dim": "moe_hidden",
            "every": "moe_every",
        }
        return {
            shape_name: getattr(self, key)
            for key, shape_name in names.items()
            if getattr(self, key) is not None
        }


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
        _require(self.nodes >= 1, "topology.nodes", self.nodes, "must be >= 1")
        _require(
            self.gpu_memory_gb is None or self.gpu_memory_gb > 0,
            "topology.gpu_memory_gb",
            self.gpu_memory_gb,
            "must be > 0",
        )
        for key in ("gpus_per_node", "nics_per_node"):
            value = getattr(self, key)
            _require(value is None or value >= 1, f"topology.{key}", value, "must be >= 1")
        for key in ("intra_node_gbytes_per_s", "nic_gbits_per_s"):
            value = getattr(self, key)
            _require(value is None or value > 0, f"topology.{key}", value, "must be > 0")
        for key in ("intra_node_latency_us", "inter_node_latency_us"):
            value = getattr(self, key)
            _require(value is None or value >= 0, f"topology.{key}", value, "must be >= 0")


@dataclass
class ModelConfig:
    preset: str = "tiny"
    """tiny or tiny_moe (CPU demos) or a paper shape: 3b, 7b, 13b, 30b, 8x550m,
    gpt_moe_s, gpt_moe_m, gpt_moe_l."""
    vocab_size: int | None = None
    """Override the preset's vocabulary size (likewise the fields below)."""
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    rope_theta: float | None = None
    attention_kernel: str = "auto"
    """auto (on a GPU: flash-attn when installed, else torch's flash kernel for fp16/bf16;
    else torch) | torch | flash | torch_flash."""
    init_from: str | None = None
    """A local Hugging Face checkpoint directory (config.json + model.safetensors, or
    shards with model.safetensors.index.json) of a LlamaForCausalLM or
    Qwen2ForCausalLM: the model takes its shape and initial weights (see
    ray_zep.model.hf); `model.preset` is not used and a size key set here must
    repeat the checkpoint's value. Unset: a preset, randomly initialised."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-Experts blocks (the preset's unless set)."""

    def __post_init__(self) -> None:
        _require(
            self.init_from is None or bool(self.init_from.strip()),
            "model.init_from",
            self.init_from,
            "must name a checkpoint directory, or be null",
        )

    def overrides(self) -> dict[str, Any]:
        """The dense shape fields set explicitly, by name."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("preset", "attention_kernel", "init_from", "moe")
            and getattr(self, f.name) is not None
        }


@dataclass
class DataConfig:
    source: str = "stdlib"
    """stdlib (built-in text), synthetic:arxiv|github|prolong64k, or a Parquet file/folder."""
    packing: Packing = Packing.RANK
    """rank | budget (parallel.sequence=whole needs rank)."""
    overlong: Overlong = Overlong.SPLIT
    """split | drop | error, for documents longer than data.max_doc_tokens."""
    max_doc_tokens: int | None = None
    """Longest sequence in a batch; defaults to L under rank packing, nodes x GPUs x L otherwise."""
    shuffle: bool = True
    """Visit documents in a seeded random order, new each epoch."""
    length_scale: float = 1.0
    """Multiply synthetic lengths by this (e.g. 1/64 to run paper distributions on a CPU)."""
    prefetch: int = 2
    """Steps of shards the data actor prepares ahead."""
    eval_source: str | None = None
    """Held-out data for `train.eval_every` (any form `data.source` takes), never
    trained on; null: no evaluation during training."""
    batch_fill: float = 1.0
    """Share of nodes x GPUs x L a batch fills under packing=budget; below 1 every rank
    may hold more tokens than the mean (up to L), room `parallel.zone_policy=work` uses
    to balance work."""
    outlier_tokens: int = 0
    """Documents of at least this many tokens are outliers that may wait for a later
    batch (`ray_zep.data.batching`); 0: off."""
    outlier_group: int = 2
    """Outliers released together: held ones open the next batch once this many wait."""
    outlier_max_delay: int = 4
    """Batches an outlier waits at most before it is released anyway."""

    def __post_init__(self) -> None:
        _require(bool(self.source), "data.source", self.source, "must not be empty")
        _require(
            self.max_doc_tokens is None or self.max_doc_tokens >= 1,
            "data.max_doc_tokens",
            self.max_doc_tokens,
            "must be >= 1",
        )
        _require(self.length_scale > 0, "data.length_scale", self.length_scale, "must be > 0")
        _require(self.prefetch >= 1, "data.prefetch", self.prefetch, "must be >= 1")
        _require(0 < self.batch_fill <= 1, "data.batch_fill", self.batch_fill, "must be in (0, 1]")
        _require(
            self.batch_fill == 1 or self.packing is Packing.BUDGET,
            "data.batch_fill",
            self.batch_fill,
            "below 1 needs data.packing=budget (rank packing fills L-token bins)",
        )
        _require(
            self.outlier_tokens >= 0,
            "data.outlier_tokens",
            self.outlier_tokens,
            "must be >= 0 (0: off)",
        )
        _require(self.outlier_group >= 1, "data.outlier_group", self.outlier_group, "must be >= 1")
        _require(
            self.outlier_max_delay >= 1,
            "data.outlier_max_delay",
            self.outlier_max_delay,
            "must be >= 1",
        )


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
            _require(value > 0, f"comm.{key}", value, "must be > 0")
        unknown = sorted(set(self.compression_streams) - set(COMPRESSION_STREAMS))
        _require(
            not unknown,
            "comm.compression_streams",
            self.compression_streams,
            f"unknown {unknown}; allowed: {', '.join(COMPRESSION_STREAMS)}",
        )
        _require(
            self.compression_refresh_calls >= 1,
            "comm.compression_refresh_calls",
            self.compression_refresh_calls,
            "must be >= 1",
        )


@dataclass
class RayConfig:
    address: str | None = None
    """Cluster to join; unset means RAY_ADDRESS, or a new local Ray."""
    num_cpus: int | None = None
    """CPUs of a new local Ray; defaults to enough for every worker and actor."""
    object_store_mb: int = 512
    """Object store of a new local Ray, MiB."""
    num_workers: int | None = None
    """Training workers; defaults to topology nodes x GPUs (1 for strategy single)."""
    max_failures: int = 2
    """Times Ray Train restarts a failed worker group (from the last checkpoint);
    0 fails the job at the first error, -1 restarts without limit."""
    min_nodes: int | None = None
    """An elastic run: the fewest nodes of the topology training goes on with. Ray Train
    then runs on the whole nodes it can get, from this many to topology.nodes: it shrinks
    the worker group when a node is lost and grows it back when nodes return, and every
    step still trains the configured global batch (in micro-batches). Unset: the run
    needs all topology.nodes."""
    resize_interval_s: float = 60.0
    """An elastic run: how often Ray Train looks for returned nodes to grow the group
    (a grown group resumes from the newest checkpoint)."""

    def __post_init__(self) -> None:
        _require(
            self.num_cpus is None or self.num_cpus >= 1,
            "ray.num_cpus",
            self.num_cpus,
            "must be >= 1",
        )
        _require(
            self.object_store_mb >= 64, "ray.object_store_mb", self.object_store_mb, "must be >= 64"
        )
        _require(
            self.num_workers is None or self.num_workers >= 1,
            "ray.num_workers",
            self.num_workers,
            "must be >= 1",
        )
        _require(
            self.max_failures >= -1,
            "ray.max_failures",
            self.max_failures,
            "must be >= 0, or -1 for unlimited",
        )
        _require(
            self.min_nodes is None or self.min_nodes >= 1,
            "ray.min_nodes",
            self.min_nodes,
            "must be >= 1 (or unset: no elastic worker group)",
        )
        _require(
            self.resize_interval_s > 0,
            "ray.resize_interval_s",
            self.resize_interval_s,
            "must be > 0",
        )


@dataclass
class MetricsConfig:
    port: int = constants.DEFAULT_METRICS_PORT
    """Prometheus endpoint of the driver; 0 picks a free port, -1 turns it off."""
    host: str = "127.0.0.1"
    """Address the endpoint binds: loopback by default; 0.0.0.0 (or the pod's address)
    where a Prometheus outside the machine scrapes it, as in deploy/."""
    progress: bool = True
    """Show a progress bar with tokens/s and loss."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one GPU for the MFU metric; 0: the datasheet BF16 peak of
    a known GPU (A100/A800 312, H100/H800/H200 989), no MFU otherwise."""
    memory_every: int = 10
    """On CPU, measure a step's peak tensor memory every k steps, from the second on
    (the tracker slows that step by about half); 0 never. GPUs read the allocator's
    peak every step."""
    tensorboard: str | None = None
    """Directory of TensorBoard event files (relative: under train.out_dir); null: none.
    Every scalar of metrics.jsonl, per step. Needs `pip install 'ray-zep[tensorboard]'`."""
    wandb: str | None = None
    """Weights & Biases project to log every scalar of metrics.jsonl to; null: none.
    WANDB_MODE=offline writes the run under train.out_dir/wandb with no network. Needs
    `pip install 'ray-zep[wandb]'`."""
    wandb_run: str | None = None
    """The W&B run's name; null: the run directory's name. A resumed run logs to the
    same W&B run (its id comes from the run directory)."""

    def __post_init__(self) -> None:
        for key in ("tensorboard", "wandb", "wandb_run"):
            value = getattr(self, key)
            _require(value is None or bool(value.strip()), f"metrics.{key}", value,
                     "must be a non-empty name, or null")  # fmt: skip
        _require(self.memory_every >= 0, "metrics.memory_every", self.memory_every, "must be >= 0")
        _require(-1 <= self.port <= 65535, "metrics.port", self.port, "must be -1, 0 or a port")
        _require(bool(self.host.strip()), "metrics.host", self.host, "must be an address")
        _require(self.peak_tflops >= 0, "metrics.peak_tflops", self.peak_tflops, "must be >= 0")


@dataclass
class Config:
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        parallel = self.parallel
        moe_model = build_shape(self.model).moe_experts > 0
        refused = refusal(
            AxesChoice(
                parallel.sequence,
                parallel.weights,
                parallel.ep,
                moe_model,
                parallel.routing,
                parallel.remap,
                parallel.reference_layout,
            )
        )
        if refused is not None:
            key, why = refused
            value = getattr(parallel, key.split(".")[1])
            raise ConfigError(f"config key {key}={_word(value)}: {why}")
        seq = parallel.sequence_axis
        if parallel.reference_layout is not None:
            seq = SEQUENCE_AXES[parallel.reference_layout]  # the packing of the mirrored run
        if seq.whole_sequences and not seq.one_process and self.data.packing is not Packing.RANK:
            raise ConfigError(
                f"config key data.packing='budget': parallel.sequence={seq.name} keeps each "
                "sequence on one rank and needs data.packing=rank"
            )
        if self.train.eval_every and not self.data.eval_source:
            raise ConfigError(
                f"config key train.eval_every={self.train.eval_every}: evaluation reads "
                "held-out data; set data.eval_source (a Parquet file, stdlib, synthetic:...)"
            )


def _word(value: Any) -> str:
    return value.value if isinstance(value, Enum) else str(value).lower()


LEGACY_STRATEGIES = {
    "dp": (Placement.WHOLE, WeightsMode.REPLICATED),
    **{p.value: (p, WeightsMode.REPLICATED) for p in Placement if p is not Placement.WHOLE},
    **{w.value: (Placement.WHOLE, w) for w in WeightsMode if w is not WeightsMode.REPLICATED},
    **{old: (Placement.WHOLE, mode) for old, (mode, _) in RENAMED_WEIGHTS.items()},
}
"""What each value of the former `parallel.strategy` key is in the axes."""


def _refuse_strategy_key(value: Any) -> None:
    """A config that still sets `parallel.strategy` gets the keys that replace it."""
    sequence, weights = LEGACY_STRATEGIES.get(str(value), (Placement.WHOLE, WeightsMode.REPLICATED))
    raise ConfigError(
        f"config key parallel.strategy={value} was replaced by parallel.sequence and "
        f"parallel.weights: use parallel.sequence={sequence.value} "
        f"parallel.weights={weights.value}"
    )


def _refuse_renamed_weights(value: Any) -> None:
    """A config that names a former `parallel.weights` value gets today's name and why."""
    if isinstance(value, str) and value.strip() in RENAMED_WEIGHTS:
        mode, why = RENAMED_WEIGHTS[value.strip()]
        raise ConfigError(
            f"config key parallel.weights={value.strip()} was renamed: use "
            f"parallel.weights={mode.value}, the same executor; {why}"
        )


def renamed_overrides(path: str | Path) -> list[str]:
    """Overrides that bring a run directory's saved config up to today's names.

    A config.yaml an earlier version wrote may name a renamed weights mode; reading
    that run (its checkpoint, `ray-zep export` / `eval`) needs the mode's current name,
    for the executor is the same. Returns [] for anything but such a file.
    """
    try:
        content = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return []
    parallel = content.get("parallel") if isinstance(content, dict) else None
    old = parallel.get("weights") if isinstance(parallel, dict) else None
    if not isinstance(old, str) or old not in RENAMED_WEIGHTS:
        return []
    mode = RENAMED_WEIGHTS[old][0]
    log.info("%s: parallel.weights=%s is now called %s", path, old, mode.value)
    return [f"parallel.weights={mode.value}"]


@functools.cache
def _schema() -> Any:
    """The defaults as OmegaConf's typed tree, built once per process: building it costs
    most of a load (about 10 ms), and `OmegaConf.merge` copies its first argument, so
    every load still starts from an untouched tree."""
    return OmegaConf.structured(Config)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Merge the defaults, a YAML file and `key=value` overrides into a Config.

    Args:
        path: YAML file, or None for the defaults alone.
        overrides: CLI dotlist items such as `train.steps=5`.

    Returns:
        The validated Config.

    Raises:
        ConfigError: the file is missing or not YAML, an override is malformed,
            a key is unknown, a value has the wrong type or is out of range, or
            `parallel.weights` names a renamed mode (`RENAMED_WEIGHTS`).
    """
    layers = [_schema()]
    if path is not None:
        layers.append(_load_yaml(Path(path), overrides))
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} must look like key=value, e.g. train.steps=5")
        key, value = (part.strip() for part in item.split("=", 1))
        if key == "parallel.strategy":
            _refuse_strategy_key(value)
        if key == "parallel.weights":
            _refuse_renamed_weights(value)
    try:
        dotlist = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)))
        layers.append(OmegaConf.create(_enum_words_back(dotlist, Config)))
        merged = OmegaConf.merge(*layers)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except ConfigKeyError as exc:
        raise ConfigError(f"unknown config key '{exc.full_key}'{_suggestion(exc)}") from None
    except OmegaConfBaseException as exc:
        key = str(getattr(exc, "full_key", "?"))
        detail = str(getattr(exc, "msg", exc)).splitlines()[0]
        field_type = _schema_type(key.split("."))
        if isinstance(field_type, type) and issubclass(field_type, Enum):
            allowed = " | ".join(member.value for member in field_type)
            detail = f"{detail.split(',')[0]}, expected {allowed}"
        raise ConfigError(f"config key {key}: {detail}") from None


PRESET_SIZES = ("gpus_per_node", "nics_per_node")
"""Topology keys a named preset fixes (see `ray_zep.topology.build_topology`)."""


def _preset_sizes_win(content: Any, overrides: Sequence[str], path: Path) -> Any:
    """A named `topology.preset` given as an override replaces the sizes the file pins
    (the command line is the later word); sizes given as overrides too still meet the
    preset's check."""
    given = {k.strip(): v for k, _, v in (item.partition("=") for item in overrides)}
    preset = given.get("topology.preset", "").strip()
    topology = content.get("topology") if isinstance(content, dict) else None
    if not preset or preset == "virtual" or not isinstance(topology, dict):
        return content
    for key in PRESET_SIZES:
        if key in topology and f"topology.{key}" not in given:
            log.info(
                "topology.preset=%s fixes topology.%s: %s's value %s is not used",
                preset, key, path, topology.pop(key),
            )  # fmt: skip
    return content


def _load_yaml(path: Path, overrides: Sequence[str] = ()) -> Any:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        content = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0]
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {first}") from None
    if content is None:
        content = {}
    if not isinstance(content, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    parallel = content.get("parallel")
    if isinstance(parallel, dict) and "strategy" in parallel:
        _refuse_strategy_key(parallel["strategy"])
    if isinstance(parallel, dict) and str(parallel.get("weights")) in RENAMED_WEIGHTS:
        if any(item.partition("=")[0].strip() == "parallel.weights" for item in overrides):
            parallel.pop("weights")  # the command line is the later word
        else:
            _refuse_renamed_weights(parallel["weights"])
    content = _preset_sizes_win(content, overrides, path)
    return OmegaConf.create(_enum_words_back(content, Config))


YAML_BOOLEAN_WORDS = {False: ("off", "no", "false"), True: ("on", "yes", "true")}


def _enum_words_back(data: Any, schema: Any) -> Any:
    """YAML reads `off` / `on` (and no / yes) as booleans: where the schema expects an
    enum with such a member (`comm.compression=off`), give the word back."""
    if not isinstance(data, dict) or not dataclasses.is_dataclass(schema):
        return data
    hints = typing.get_type_hints(schema)
    fixed = {}
    for key, value in data.items():
        field_type = hints.get(key)
        is_enum = isinstance(field_type, type) and issubclass(field_type, Enum)
        if isinstance(value, bool) and is_enum:
            values = {member.value for member in field_type}
            value = next((w for w in YAML_BOOLEAN_WORDS[value] if w in values), value)
        fixed[key] = _enum_words_back(value, field_type)
    return fixed


def _schema_type(parts: list[str]) -> Any:
    """The declared type at a dotted key path of the schema, or None if unknown."""
    schema: Any = Config
    for part in parts:
        if not dataclasses.is_dataclass(schema):
            return None
        hints = typing.get_type_hints(schema)
        if part not in hints:
            return None
        schema = hints[part]
    return schema


def _suggestion(exc: ConfigKeyError) -> str:
    parts = str(exc.full_key).split(".")
    section = _schema_type(parts[:-1])
    if not dataclasses.is_dataclass(section):
        return ""
    known = ", ".join(f.name for f in dataclasses.fields(section))
    return f"; {'.'.join(parts[:-1]) or 'the top level'} takes: {known}"


def config_to_dict(config: Config) -> dict[str, Any]:
    """The config as plain data (enums by value), to write out or ship to workers."""

    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return value.value if isinstance(value, Enum) else value

    return plain(config)


def config_to_yaml(config: Config) -> str:
    """The config as YAML, loadable by `load_config`."""
    return yaml.safe_dump(config_to_dict(config), sort_keys=False)


def config_from_dict(data: dict[str, Any]) -> Config:
    """Inverse of `config_to_dict`."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), data))  # type: ignore


def write_resolved_config(config: Config, run_dir: Path) -> Path:
    """Write the resolved config into the run directory and return its path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / constants.RESOLVED_CONFIG_FILE_NAME
    out.write_text(config_to_yaml(config))
    return out
