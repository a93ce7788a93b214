"""The run's topology from what a probe found on every node of the cluster.

Each node reports its GPUs and, where `nvidia-smi` and RDMA NICs allow, its
probed Topology (`ray_zep.topology_probe`). The driver then decides:

- no GPU on any node (CPU runs, laptops, CI): the configured virtual topology,
  and the log says so;
- a `virtual` config whose GPUs per node match every probed node, on at least
  `topology.nodes` such nodes: the probed topology (link rates, GPU-to-NIC
  affinity, NIC names) with the configured number of nodes;
- otherwise (a named preset, nodes that differ, a probe that failed): the
  configured topology, with the reason in the log.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from ray_zep.errors import ProbeError
from ray_zep.topology import Topology
from ray_zep.topology_probe import probe_local_node


@dataclass(frozen=True)
class NodeReport:
    """What the probe found on one node.

    Attributes:
        host: the node's host name.
        gpus: GPUs `nvidia-smi` lists (0 without it).
        topology: the probed one-node Topology as a dict, when it could be built.
        error: why it could not be built.
    """

    host: str
    gpus: int
    topology: dict[str, Any] | None = None
    error: str | None = None


def report_local_node(host: str) -> NodeReport:
    """Probe this machine (never raises: a failure is part of the report)."""
    if shutil.which("nvidia-smi") is None:
        return NodeReport(host, 0, error="no nvidia-smi on this node")
    try:
        listed = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return NodeReport(host, 0, error=f"nvidia-smi -L failed: {exc}")
    gpus = sum(1 for line in listed.splitlines() if line.startswith("GPU "))
    try:
        return NodeReport(host, gpus, topology=probe_local_node(1).to_dict())
    except ProbeError as exc:
        return NodeReport(host, gpus, error=str(exc))


def resolve_topology(
    reports: list[NodeReport], configured: Topology, least: int | None = None
) -> tuple[Topology, str]:
    """The topology to run on and one line saying where it came from (module docstring).

    `least`: an elastic run (`ray.min_nodes`) probes the nodes it starts with, which may
    be fewer than `topology.nodes` but no fewer than this."""
    hosts = len(reports)
    shape = f"{configured.nodes} x {configured.gpus_per_node}"
    gpu_nodes = [r for r in reports if r.gpus]
    if not gpu_nodes:
        return configured, (
            f"no GPU on the {hosts} Ray node(s): using the configured {configured.name} "
            f"topology ({shape})"
        )
    found = ", ".join(f"{r.host}: {r.gpus} GPU(s)" for r in gpu_nodes)
    if configured.name != "virtual":
        return configured, f"probe found {found}; using topology.preset={configured.name}"
    failed = [r for r in gpu_nodes if r.topology is None]
    if failed:
        reasons = "; ".join(f"{r.host}: {r.error}" for r in failed)
        return configured, f"probe could not read every node ({reasons}); using {shape} virtual"
    probed = [Topology.from_dict(r.topology) for r in gpu_nodes]
    matching = [t for t in probed if t.gpus_per_node == configured.gpus_per_node]
    if len(matching) < (least or configured.nodes) or len({_hardware(t) for t in matching}) > 1:
        return configured, (
            f"probe found {found}, which does not give topology.nodes={configured.nodes} "
            f"alike nodes of topology.gpus_per_node={configured.gpus_per_node}; "
            f"using {shape} virtual"
        )
    topology = matching[0].with_nodes(configured.nodes)
    return topology, f"probed topology ({found}):\n{topology.describe()}"


def _hardware(topology: Topology) -> tuple:
    """What must agree between nodes for one topology to describe them all."""
    return (topology.gpus_per_node, topology.nics_per_node, topology.gpu_to_nic)
