"""The cluster every part of the simulator plays on: one Topology and one GPU's rates.

The attention layer graph (`ray_zep.sim.program`), the MoE block
(`ray_zep.sim.moe_block`) and the weight-passing step
(`ray_zep.sim.weight_passing`) all read their links from `topology` (bandwidths
a transfer achieves, bytes/s each way; latencies per message) and their compute
from `rates` (`ray_zep.costmodel.ComputeRates`: a calibration of this machine,
or the labelled preset of the topology's GPU). A paper's testbed is a topology
preset like any cluster (`ray_zep.topology.PRESETS`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ray_zep.costmodel import ComputeRates, CostModel, preset_rates
from ray_zep.model_shapes import ModelShape
from ray_zep.run_memory import USABLE_MEMORY_FRACTION
from ray_zep.sim.events import CorePool
from ray_zep.topology import GB, GBIT, Topology


@dataclass(frozen=True)
class Hardware:
    """A cluster and the sustained rates of one of its GPUs.

    Attributes:
        topology: nodes, GPUs, NICs and links.
        rates: compute rates of one GPU (or of one process of a virtual cluster).
        collective_step: (latency s, bytes/s) of one ring-collective step where it was
            measured apart from messages (`CostModel.collective_step`); None: the links.
        pool: the cores a CPU virtual cluster's ranks share (`CorePool`); None: each
            rank computes on its own device.
        message_latency: (seconds a rank computes between two ring messages, a
            message's latency) in rising compute, where a CPU virtual cluster's
            calibration measured it (`CostModel.message_latency`); empty: the topology's.
    """

    topology: Topology
    rates: ComputeRates
    collective_step: tuple[float, float] | None = None
    pool: CorePool | None = None
    message_latency: tuple[tuple[float, float], ...] = ()

    @classmethod
    def preset(cls, topology: Topology) -> Hardware:
        """The topology with its GPU's preset rates (A800's when unknown)."""
        return cls(topology, preset_rates(topology.gpu_model))

    def cost(self, shape: ModelShape) -> CostModel:
        """The link and attention times of `shape` on this cluster."""
        return CostModel(
            shape,
            self.topology,
            self.rates.attention_forward,
            self.collective_step,
            self.message_latency,
        )

    @property
    def nodes(self) -> int:
        return self.topology.nodes

    @property
    def gpus_per_node(self) -> int:
        return self.topology.gpus_per_node

    @property
    def devices(self) -> int:
        return self.topology.world_size

    @property
    def node_nic_bandwidth(self) -> float:
        """Bytes/s one node sends (and receives) across nodes over all its NICs."""
        return self.topology.nics_per_node * self.topology.nic_bandwidth

    @property
    def intra_bandwidth(self) -> float:
        return self.topology.intra_node_bandwidth

    @property
    def inter_latency(self) -> float:
        return self.topology.inter_node_latency

    @property
    def intra_latency(self) -> float:
        return self.topology.intra_node_latency

    @property
    def usable_memory_bytes(self) -> float:
        """Memory a step can use on one GPU (infinite when the topology names none)."""
        total = self.topology.gpu_memory_bytes
        return total * USABLE_MEMORY_FRACTION if total > 0 else float("inf")

    @property
    def source(self) -> str:
        t = self.topology
        return (
            f"{t.name}: {t.nodes} x {t.gpus_per_node} {t.gpu_model}, {t.nics_per_node} x "
            f"{t.nic_bandwidth / GBIT:g} Gb/s NICs per node, {t.intra_node_bandwidth / GB:g} "
            f"GB/s per GPU in a node; rates: {self.rates.source}"
        )

    def with_links(
        self, nic_gbits_per_s: float | None = None, intra_gbytes_per_s: float | None = None
    ) -> Hardware:
        """The same cluster with other per-NIC / per-GPU bandwidths (None: unchanged)."""
        changes = {}
        if nic_gbits_per_s is not None:
            changes["nic_bandwidth"] = nic_gbits_per_s * GBIT
        if intra_gbytes_per_s is not None:
            changes["intra_node_bandwidth"] = intra_gbytes_per_s * GB
        return dataclasses.replace(self, topology=dataclasses.replace(self.topology, **changes))
