"""The machinery around a run: the Ray cluster it uses (`ray`) and what it reports
(`metrics`). Each section checks its own keys in `__post_init__`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_zep import constants
from ray_zep.config.rules import require


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
        require(
            self.num_cpus is None or self.num_cpus >= 1,
            "ray.num_cpus",
            self.num_cpus,
            "must be >= 1",
        )
        require(
            self.object_store_mb >= 64, "ray.object_store_mb", self.object_store_mb, "must be >= 64"
        )
        require(
            self.num_workers is None or self.num_workers >= 1,
            "ray.num_workers",
            self.num_workers,
            "must be >= 1",
        )
        require(
            self.max_failures >= -1,
            "ray.max_failures",
            self.max_failures,
            "must be >= 0, or -1 for unlimited",
        )
        require(
            self.min_nodes is None or self.min_nodes >= 1,
            "ray.min_nodes",
            self.min_nodes,
            "must be >= 1 (or unset: no elastic worker group)",
        )
        require(
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
    summary_gpus: list[int] = field(default_factory=list)
    """Cluster sizes (GPUs of cluster A, multiples of 8) at which the closing summary of
    `ray-zep train` models this run's document lengths with a 7B model: the product's
    placement against TE CP and Megatron-LM's dynamic CP (`ray_zep.bench.real_shape`;
    about 10 s at 1,024 GPUs); [] (the default; the demo sets [64, 1024]) leaves it out."""

    def __post_init__(self) -> None:
        for key in ("tensorboard", "wandb", "wandb_run"):
            value = getattr(self, key)
            require(value is None or bool(value.strip()), f"metrics.{key}", value,
                     "must be a non-empty name, or null")  # fmt: skip
        require(self.memory_every >= 0, "metrics.memory_every", self.memory_every, "must be >= 0")
        require(-1 <= self.port <= 65535, "metrics.port", self.port, "must be -1, 0 or a port")
        require(bool(self.host.strip()), "metrics.host", self.host, "must be an address")
        require(self.peak_tflops >= 0, "metrics.peak_tflops", self.peak_tflops, "must be >= 0")
        whole_nodes = all(g >= 8 and g % 8 == 0 for g in self.summary_gpus)
        require(whole_nodes, "metrics.summary_gpus", self.summary_gpus,
                "must be GPU counts, multiples of 8 (cluster A's nodes)")  # fmt: skip
