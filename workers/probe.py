"""One topology probe actor per Ray node; the driver resolves the run's topology from them."""

from __future__ import annotations

import dataclasses
import socket

import ray
from ray.exceptions import GetTimeoutError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_zep.errors import TopologyError
from ray_zep.topology_resolve import NodeReport, report_local_node


@ray.remote(num_cpus=0)
class TopologyProbe:
    """Reports its node's GPUs, NICs and GPU-to-NIC affinity."""

    def report(self) -> dict:
        return dataclasses.asdict(report_local_node(socket.gethostname()))


def probe_cluster(timeout_s: float) -> list[NodeReport]:
    """Every alive node's report. Where no node offers Ray a GPU, the workers cannot take
    one, and every report says so without starting a probe on each node.

    Raises:
        TopologyError: a node did not answer within `timeout_s`.
    """
    alive = [node for node in ray.nodes() if node.get("Alive")]
    if not any(node["Resources"].get("GPU") for node in alive):
        return [
            NodeReport(node.get("NodeManagerHostname", ""), 0, error="the Ray node offers no GPU")
            for node in alive
        ]
    nodes = [node["NodeID"] for node in alive]
    probes = [
        TopologyProbe.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote()
        for node in nodes
    ]
    try:
        reports = ray.get([probe.report.remote() for probe in probes], timeout=timeout_s)
    except GetTimeoutError:
        raise TopologyError(
            f"the topology probe got no answer from all {len(nodes)} Ray node(s) within "
            f"{timeout_s:.0f} s (comm.init_timeout_s); check that every node can start actors"
        ) from None
    finally:
        for probe in probes:
            ray.kill(probe)
    return [NodeReport(**report) for report in reports]
