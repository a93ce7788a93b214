"""Every metric ray_zep exports, named in one place.

Prometheus conventions: `ray_zep_` prefix, base units (seconds, bytes),
counters end in `_total`, labels have few values. The driver serves these with
prometheus-client (`workers/metrics_export.py`); dashboards may only query
names listed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Kind(Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    """Exposed name (counters include `_total`)."""
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()


TOKENS = MetricSpec("ray_zep_tokens_total", Kind.COUNTER, "Tokens trained on, all ranks.")
STEPS = MetricSpec("ray_zep_steps_total", Kind.COUNTER, "Optimizer steps finished by this driver.")
STEP = MetricSpec("ray_zep_step", Kind.GAUGE, "Number of the last finished step.")
TOKENS_PER_SECOND = MetricSpec(
    "ray_zep_tokens_per_second", Kind.GAUGE, "Tokens per second of the last step, all ranks."
)
STEP_SECONDS = MetricSpec("ray_zep_step_seconds", Kind.GAUGE, "Wall time of the last step.")
STEP_DURATION = MetricSpec(
    "ray_zep_step_duration_seconds", Kind.HISTOGRAM, "Distribution of step wall times."
)
DATA_WAIT_SECONDS = MetricSpec(
    "ray_zep_data_wait_seconds", Kind.GAUGE, "Time rank 0 waited for its shard in the last step."
)
LOSS = MetricSpec("ray_zep_loss", Kind.GAUGE, "Mean token cross-entropy of the last step.")
LEARNING_RATE = MetricSpec("ray_zep_learning_rate", Kind.GAUGE, "Learning rate of the last step.")
GRAD_NORM = MetricSpec("ray_zep_grad_norm", Kind.GAUGE, "Global gradient norm before clipping.")
COMM_BYTES = MetricSpec(
    "ray_zep_communication_bytes_total",
    Kind.COUNTER,
    "Bytes moved between ranks, by link kind (modelled from the plan).",
    ("link",),
)
NIC_BYTES = MetricSpec(
    "ray_zep_nic_bytes_total",
    Kind.COUNTER,
    "Bytes sent between nodes, by node and NIC (modelled from the plan).",
    ("node", "nic"),
)
RANK_TOKEN_IMBALANCE = MetricSpec(
    "ray_zep_rank_token_imbalance",
    Kind.GAUGE,
    "Max over mean of per-rank tokens in the last step (1 = even).",
)
COMPRESSION_RATIO = MetricSpec(
    "ray_zep_compression_ratio",
    Kind.GAUGE,
    "Raw over sent bytes of a compressible stream in the last step (1 = no gain).",
    ("stream",),
)
COMPRESSION_RAW_BYTES = MetricSpec(
    "ray_zep_compression_raw_bytes_total",
    Kind.COUNTER,
    "Bytes handed to a compressible stream's transfers, all ranks (measured).",
    ("stream",),
)
COMPRESSION_WIRE_BYTES = MetricSpec(
    "ray_zep_compression_wire_bytes_total",
    Kind.COUNTER,
    "Bytes a compressible stream's transfers sent, all ranks (measured).",
    ("stream",),
)
CHECKPOINTS = MetricSpec("ray_zep_checkpoints_total", Kind.COUNTER, "Checkpoints written.")
RANKS = MetricSpec(
    "ray_zep_ranks", Kind.GAUGE, "Training processes (GPUs) of the job, as configured."
)
WORLD_SIZE = MetricSpec(
    "ray_zep_world_size",
    Kind.GAUGE,
    "Ranks training now (fewer than ray_zep_ranks while an elastic run has lost nodes).",
)
LIVE_NODES = MetricSpec("ray_zep_live_nodes", Kind.GAUGE, "Topology nodes training now.")
RESIZES = MetricSpec(
    "ray_zep_resizes_total",
    Kind.COUNTER,
    "Times an elastic run's worker group changed size, by reason (node_lost, nodes_returned).",
    ("reason",),
)
CHECKPOINT_STEP = MetricSpec(
    "ray_zep_checkpoint_step", Kind.GAUGE, "Step of the newest checkpoint."
)

ZONE_TOKENS = MetricSpec(
    "ray_zep_zone_tokens_total",
    Kind.COUNTER,
    "Tokens by the zone their attention runs in (local, intra_node, inter_node).",
    ("zone",),
)
MODEL_FLOPS_PER_SECOND = MetricSpec(
    "ray_zep_model_flops_per_second",
    Kind.GAUGE,
    "Model FLOPs (forward + backward, no recompute) per second of the last step, all ranks.",
)
MFU = MetricSpec(
    "ray_zep_mfu_ratio",
    Kind.GAUGE,
    "Model FLOPs utilisation of the last step: model FLOP/s over ranks x peak (0-1).",
)
RANK_MEMORY = MetricSpec(
    "ray_zep_rank_memory_bytes",
    Kind.GAUGE,
    "Peak memory of the fullest rank in the last step: modelled, and measured where it was.",
    ("kind",),
)
EVAL_LOSS = MetricSpec(
    "ray_zep_eval_loss",
    Kind.GAUGE,
    "Validation loss (mean over label tokens of data.eval_source) of the last evaluation.",
)
RESTARTS = MetricSpec(
    "ray_zep_restarts_total",
    Kind.COUNTER,
    "Times the training workers restarted from a checkpoint during this job.",
)

PROCESS_RESIDENT_BYTES = MetricSpec(
    "ray_zep_process_resident_bytes",
    Kind.GAUGE,
    "Resident memory after the last step: the driver, the data actor, the largest rank.",
    ("process",),
)
PROCESS_OPEN_FDS = MetricSpec(
    "ray_zep_process_open_fds",
    Kind.GAUGE,
    "Open file descriptors after the last step: the driver, the data actor, the most of a rank.",
    ("process",),
)

ALL_METRICS: tuple[MetricSpec, ...] = (
    EVAL_LOSS,
    TOKENS,
    STEPS,
    STEP,
    TOKENS_PER_SECOND,
    STEP_SECONDS,
    STEP_DURATION,
    DATA_WAIT_SECONDS,
    LOSS,
    LEARNING_RATE,
    GRAD_NORM,
    COMM_BYTES,
    NIC_BYTES,
    RANK_TOKEN_IMBALANCE,
    COMPRESSION_RATIO,
    COMPRESSION_RAW_BYTES,
    COMPRESSION_WIRE_BYTES,
    CHECKPOINTS,
    CHECKPOINT_STEP,
    RANKS,
    ZONE_TOKENS,
    MODEL_FLOPS_PER_SECOND,
    MFU,
    RANK_MEMORY,
    RESTARTS,
    WORLD_SIZE,
    LIVE_NODES,
    RESIZES,
    PROCESS_RESIDENT_BYTES,
    PROCESS_OPEN_FDS,
)

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)


def create_metrics(registry: CollectorRegistry) -> dict[str, Counter | Gauge | Histogram]:
    """Instantiate every metric on `registry`, keyed by exposed name."""
    made: dict[str, Counter | Gauge | Histogram] = {}
    for spec in ALL_METRICS:
        if spec.kind is Kind.COUNTER:
            base = spec.name.removesuffix("_total")
            made[spec.name] = Counter(base, spec.help, spec.labels, registry=registry)
        elif spec.kind is Kind.GAUGE:
            made[spec.name] = Gauge(spec.name, spec.help, spec.labels, registry=registry)
        else:
            made[spec.name] = Histogram(
                spec.name, spec.help, spec.labels, registry=registry, buckets=STEP_BUCKETS
            )
    return made
