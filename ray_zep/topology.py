"""Cluster topology: nodes, GPUs, NICs, GPU->NIC affinity and link speeds.

Ranks are numbered node-major: rank r sits on node r // G as local GPU r % G
(G = GPUs per node), which is how Ray Train orders workers by node and how the
virtual topology of a CPU run lays its processes out.

Units are base units: bandwidth in bytes/s *each way*, latency in seconds.

Presets are the Zeppelin paper's clusters (its §5 "Experimental Setup"):

- cluster_a: 8x A800-80G per node, NVSwitch 400 GB/s (bidirectional, so 200 GB/s
  each way), 4 RoCE NICs of 200 Gb/s, each shared by 2 GPUs.
- cluster_b: 8x H800 per node with 8 RoCE NICs, one per GPU. The paper does not
  state the NIC speed; 400 Gb/s is assumed because the paper reports cluster A as
  the one with the larger compute-to-communication ratio, which holds with
  400 Gb/s NICs (989 TFLOP/s / 400 Gb/s < 312 TFLOP/s / 100 Gb/s per GPU) and not
  with 200 Gb/s. NVLink: 400 GB/s bidirectional (H800 specification).
- cluster_c: 8x H200 per node, 8 CX7 NICs of 400 Gb/s, one per GPU. NVLink 900 GB/s
  bidirectional (H200 specification; the paper does not state it).

Latencies are not given by the paper; presets assume 3 us inside a node and
10 us across RoCE, typical small-message figures for these fabrics.

Two more presets are the testbeds of the FoldMoE and TawPipe papers, for their
simulated setups; their bandwidths are what a transfer achieves, not line rates:

- foldmoe_a10g: 2 x g5.48xlarge, 8 A10G per node on PCIe without NVLink (5 GB/s
  per GPU each way, staged through the host) and one 100 Gb/s NIC per node of
  which 40% is achieved (g5 has no EFA; NCCL uses its socket transport); 50 us
  per message. The paper states the instance type and the 100 Gb/s line; the
  achieved shares are assumptions.
- tawpipe_a100: 3 nodes x 8 GPUs with one 10 GbE NIC per node (90% achieved).
  The paper names no GPU: A100-80GB with 200 GB/s NVLink each way is assumed,
  5 us inside a node and 50 us across the Ethernet.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from ray_zep.errors import TopologyError

if TYPE_CHECKING:  # annotations only: the config sits above the topology it describes
    from ray_zep.config import TopologyConfig

GB = 1e9
GBIT = 1e9 / 8
US = 1e-6


class LinkKind(Enum):
    """Kind of link a transfer between two ranks crosses."""

    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"


@dataclass(frozen=True)
class Topology:
    """The hardware a run is laid out on.

    Attributes:
        name: preset name, "virtual" or "probed".
        nodes: number of nodes.
        gpus_per_node: GPUs (ranks) per node.
        nics_per_node: inter-node NICs per node.
        gpu_to_nic: local GPU index -> local NIC index it sends through.
        intra_node_bandwidth: per-GPU intra-node bandwidth, bytes/s each way.
        nic_bandwidth: per-NIC inter-node bandwidth, bytes/s each way.
        intra_node_latency: seconds per intra-node message.
        inter_node_latency: seconds per inter-node message.
        gpu_model: GPU name, for reports.
        gpu_memory_bytes: memory of one GPU (0: unknown, as on a virtual topology);
            `ray-zep plan` refuses a plan whose per-rank memory exceeds it.
        nic_names: device names of the NICs (probed topologies), for NCCL settings.
    """

    name: str
    nodes: int
    gpus_per_node: int
    nics_per_node: int
    gpu_to_nic: tuple[int, ...]
    intra_node_bandwidth: float
    nic_bandwidth: float
    intra_node_latency: float
    inter_node_latency: float
    gpu_model: str = "virtual"
    nic_names: tuple[str, ...] = ()
    gpu_memory_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or self.nics_per_node < 1:
            raise TopologyError(
                f"topology needs >= 1 node, GPU and NIC, got nodes={self.nodes} "
                f"gpus_per_node={self.gpus_per_node} nics_per_node={self.nics_per_node}"
            )
        if len(self.gpu_to_nic) != self.gpus_per_node:
            raise TopologyError(
                f"gpu_to_nic has {len(self.gpu_to_nic)} entries for {self.gpus_per_node} GPUs"
            )
        bad = [nic for nic in self.gpu_to_nic if not 0 <= nic < self.nics_per_node]
        if bad:
            raise TopologyError(
                f"gpu_to_nic names NIC {bad[0]} but a node has {self.nics_per_node} NICs"
            )
        if self.nic_names and len(self.nic_names) != self.nics_per_node:
            raise TopologyError(
                f"{len(self.nic_names)} NIC names given for {self.nics_per_node} NICs"
            )
        if min(self.intra_node_bandwidth, self.nic_bandwidth) <= 0:
            raise TopologyError("topology bandwidths must be > 0")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        if not 0 <= rank < self.nodes * self.gpus_per_node:  # hot: planning calls it per hop
            self._rank_error(rank)
        return rank // self.gpus_per_node

    def local_index(self, rank: int) -> int:
        if not 0 <= rank < self.nodes * self.gpus_per_node:
            self._rank_error(rank)
        return rank % self.gpus_per_node

    def ranks_of_node(self, node: int) -> range:
        if not 0 <= node < self.nodes:
            raise TopologyError(f"node {node} is outside 0..{self.nodes - 1}")
        return range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node)

    def nic_of(self, rank: int) -> int:
        """Local index of the NIC rank `rank` sends inter-node traffic through."""
        return self.gpu_to_nic[self.local_index(rank)]

    def gpus_on_nic(self, nic: int) -> tuple[int, ...]:
        """Local GPU indices that share local NIC `nic`."""
        return tuple(g for g, n in enumerate(self.gpu_to_nic) if n == nic)

    def link_kind(self, src: int, dst: int) -> LinkKind:
        same_node = self.node_of(src) == self.node_of(dst)
        return LinkKind.INTRA_NODE if same_node else LinkKind.INTER_NODE

    def with_nodes(self, nodes: int) -> Topology:
        """The same node hardware, `nodes` times."""
        data = asdict(self)
        data["nodes"] = nodes
        return Topology(**data)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["gpu_to_nic"] = list(self.gpu_to_nic)
        data["nic_names"] = list(self.nic_names)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Topology:
        return cls(
            **{
                **data,
                "gpu_to_nic": tuple(data["gpu_to_nic"]),
                "nic_names": tuple(data.get("nic_names", ())),
            }
        )

    def describe(self) -> str:
        """A short human-readable table of the topology."""
        sharing = ", ".join(
            f"NIC{nic}<-GPU{','.join(map(str, self.gpus_on_nic(nic)))}"
            for nic in range(self.nics_per_node)
        )
        return "\n".join(
            [
                f"topology {self.name}: {self.nodes} node(s) x {self.gpus_per_node} "
                f"{self.gpu_model} = {self.world_size} ranks",
                f"  intra-node: {self.intra_node_bandwidth / GB:.0f} GB/s each way per GPU, "
                f"{self.intra_node_latency / US:.1f} us",
                f"  inter-node: {self.nics_per_node} NIC(s) x {self.nic_bandwidth / GBIT:.0f} Gb/s "
                f"each way, {self.inter_node_latency / US:.1f} us",
                f"  affinity:   {sharing}",
            ]
        )

    def _rank_error(self, rank: int) -> None:
        raise TopologyError(f"rank {rank} is outside 0..{self.world_size - 1}")


def even_affinity(gpus: int, nics: int) -> tuple[int, ...]:
    """Share NICs evenly among consecutive GPUs (GPU i -> NIC i*nics//gpus)."""
    if nics > gpus:
        raise TopologyError(
            f"topology.nics_per_node={nics} exceeds topology.gpus_per_node={gpus}: "
            "every NIC needs a GPU beside it"
        )
    return tuple(g * nics // gpus for g in range(gpus))


@dataclass(frozen=True)
class NodeHardware:
    """Per-node hardware of a preset (the node count comes from the config)."""

    gpu_model: str
    gpus: int
    nics: int
    intra_gbytes_per_s: float
    nic_gbits_per_s: float
    intra_latency_us: float = 3.0
    inter_latency_us: float = 10.0
    gpu_memory_gb: float = 0.0
    """The GPU's memory (datasheet, GB = 1e9 bytes); 0 when unknown."""


PRESETS: dict[str, NodeHardware] = {
    "virtual": NodeHardware("virtual", 1, 1, 200.0, 200.0),
    "cluster_a": NodeHardware("A800-80G", 8, 4, 200.0, 200.0, gpu_memory_gb=80.0),
    "cluster_b": NodeHardware("H800", 8, 8, 200.0, 400.0, gpu_memory_gb=80.0),
    "cluster_c": NodeHardware("H200", 8, 8, 450.0, 400.0, gpu_memory_gb=141.0),
    "foldmoe_a10g": NodeHardware("A10G", 8, 1, 5.0, 40.0, 50.0, 50.0, gpu_memory_gb=24.0),
    "tawpipe_a100": NodeHardware("A100-80GB", 8, 1, 200.0, 9.0, 5.0, 50.0, gpu_memory_gb=80.0),
}


def build_topology(cfg: TopologyConfig) -> Topology:
    """The Topology a `topology:` config section describes.

    Raises:
        TopologyError: unknown preset, or sizes that contradict the preset.
    """
    if cfg.preset not in PRESETS:
        raise TopologyError(
            f"topology.preset={cfg.preset!r} is unknown; choose one of {', '.join(PRESETS)}"
        )
    hw = PRESETS[cfg.preset]
    fixed = cfg.preset != "virtual"
    gpus = _pick(cfg.gpus_per_node, hw.gpus, fixed, "gpus_per_node", cfg.preset)
    nics = _pick(cfg.nics_per_node, hw.nics if fixed else gpus, fixed, "nics_per_node", cfg.preset)
    return Topology(
        name=cfg.preset,
        nodes=cfg.nodes,
        gpus_per_node=gpus,
        nics_per_node=nics,
        gpu_to_nic=even_affinity(gpus, nics),
        intra_node_bandwidth=(cfg.intra_node_gbytes_per_s or hw.intra_gbytes_per_s) * GB,
        nic_bandwidth=(cfg.nic_gbits_per_s or hw.nic_gbits_per_s) * GBIT,
        intra_node_latency=_or(cfg.intra_node_latency_us, hw.intra_latency_us) * US,
        inter_node_latency=_or(cfg.inter_node_latency_us, hw.inter_latency_us) * US,
        gpu_model=hw.gpu_model,
        gpu_memory_bytes=(cfg.gpu_memory_gb or hw.gpu_memory_gb) * GB,
    )


def _pick(value: int | None, preset_value: int, fixed: bool, key: str, preset: str) -> int:
    if value is None:
        return preset_value
    if fixed and value != preset_value:
        raise TopologyError(
            f"topology.{key}={value} contradicts topology.preset={preset} "
            f"({preset_value}); drop the key or use topology.preset=virtual"
        )
    return value


def _or(value: float | None, default: float) -> float:
    return default if value is None else value
