"""FLOPs, bytes and times of the operations the planners and the simulator weigh.

Units: FLOPs, bytes, seconds, bytes/s. Times use the alpha-beta link model
(`latency + bytes / bandwidth`) and an attention throughput per GPU.

Compute rates come from the GPU's dense BF16 peak times an efficiency; the
peaks are the vendors' specification figures (A800 312 TFLOP/s, H800/H200
989 TFLOP/s) and the efficiency (0.5) is an assumption about varlen
flash-attention on long sequences, to be replaced by calibrated figures when
measurements exist. A virtual topology is modelled as A800 nodes, so that
plans made on a laptop look like plans made for cluster A.

The crossover chunk length of a link is the Fig. 5 reading of the Zeppelin
paper: one ring step over a chunk of m tokens per rank computes an m x m block
(time proportional to m^2) while it sends the chunk's K and V (time
proportional to m). Past the crossover the transfer hides behind the compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ray_zep.model.shapes import ModelShape
from ray_zep.topology import LinkKind, Topology

PEAK_BF16_FLOPS = {
    "A800": 312e12,
    "A100": 312e12,
    "H800": 989e12,
    "H100": 989e12,
    "H200": 989e12,
}
"""Dense BF16 tensor-core peak per GPU (vendor specifications)."""
DEFAULT_PEAK_FLOPS = 312e12
ATTENTION_EFFICIENCY = 0.5
"""Assumed fraction of peak that varlen attention reaches."""
BYTES_PER_ELEMENT = 2
"""Activations travel in BF16."""


def peak_flops(gpu_model: str) -> float:
    """Peak BF16 FLOP/s of a GPU named like `NVIDIA H100 80GB HBM3` or `A800`."""
    name = gpu_model.upper()
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return DEFAULT_PEAK_FLOPS


def causal_attention_flops(length: float, shape: ModelShape) -> float:
    """Forward FLOPs of causal attention over one sequence, one layer.

    QK^T and PV are 2 x s^2 x H x E multiply-adds each; the causal mask halves them.
    """
    return 2.0 * length * length * shape.n_heads * shape.head_dim


def block_attention_flops(q_tokens: float, kv_tokens: float, shape: ModelShape) -> float:
    """Forward FLOPs of a full (unmasked) q x kv attention block, one layer."""
    return 4.0 * q_tokens * kv_tokens * shape.n_heads * shape.head_dim


def kv_bytes_per_token(shape: ModelShape) -> int:
    """Bytes of one token's K and V with the model's own KV head count."""
    return 2 * shape.n_kv_heads * shape.head_dim * BYTES_PER_ELEMENT


def q_bytes_per_token(shape: ModelShape) -> int:
    return shape.n_heads * shape.head_dim * BYTES_PER_ELEMENT


@dataclass(frozen=True)
class CostModel:
    """Attention compute and link times of one model on one topology.

    Attributes:
        shape: the model (head counts and head dim matter here).
        topology: links, latencies and GPU model.
        attention_flops_per_s: sustained attention throughput of one GPU.
    """

    shape: ModelShape
    topology: Topology
    attention_flops_per_s: float

    @classmethod
    def create(cls, shape: ModelShape, topology: Topology) -> CostModel:
        rate = peak_flops(topology.gpu_model) * ATTENTION_EFFICIENCY
        return cls(shape, topology, rate)

    def link_bandwidth(self, kind: LinkKind, one_sender_per_nic: bool = False) -> float:
        """Bytes/s one GPU gets on a link kind.

        Across nodes a NIC is shared by the GPUs mapped to it when they all send
        at once (all-gather, all-to-all); a ring crosses a node boundary from one
        GPU per node, which then has its NIC alone (`one_sender_per_nic`).
        """
        topo = self.topology
        if kind is LinkKind.INTRA_NODE:
            return topo.intra_node_bandwidth
        if one_sender_per_nic:
            return topo.nic_bandwidth
        sharing = max(1, topo.gpus_per_node // topo.nics_per_node)
        return topo.nic_bandwidth / sharing

    def link_latency(self, kind: LinkKind) -> float:
        topo = self.topology
        return topo.intra_node_latency if kind is LinkKind.INTRA_NODE else topo.inter_node_latency

    def transfer_seconds(
        self, nbytes: float, kind: LinkKind, one_sender_per_nic: bool = False
    ) -> float:
        if nbytes <= 0:
            return 0.0
        bandwidth = self.link_bandwidth(kind, one_sender_per_nic)
        return self.link_latency(kind) + nbytes / bandwidth

    def attention_seconds(self, flops: float) -> float:
        return flops / self.attention_flops_per_s

    def causal_seconds(self, length: float) -> float:
        """Forward time of causal attention over one whole sequence on one GPU, one layer."""
        return self.attention_seconds(causal_attention_flops(length, self.shape))

    def crossover_tokens(self, kind: LinkKind) -> int:
        """Chunk length per rank above which a ring step's compute hides its KV transfer.

        Solves 4 m^2 H E / rate = m x kv_bytes / bandwidth for m (latency ignored),
        with the bandwidth of a ring hop (one sender per NIC across nodes).
        """
        per_token_s = kv_bytes_per_token(self.shape) / self.link_bandwidth(kind, True)
        per_token2_s = 4.0 * self.shape.n_heads * self.shape.head_dim / self.attention_flops_per_s
        return max(1, math.ceil(per_token_s / per_token2_s))

    def ring_seconds(self, chunk_tokens: float, ring_size: int, kind: LinkKind) -> float:
        """Forward time of a balanced zigzag ring of `ring_size` ranks over a sequence,
        each rank holding `chunk_tokens`, compute and transfer overlapped step by step."""
        if ring_size <= 1:
            return self.causal_seconds(chunk_tokens)
        half = chunk_tokens / 2
        # Own chunks: causal over their concatenation. Other steps: all q x half the kv.
        diagonal = self.causal_seconds(chunk_tokens)
        step = self.attention_seconds(block_attention_flops(chunk_tokens, half, self.shape))
        send = self.transfer_seconds(chunk_tokens * kv_bytes_per_token(self.shape), kind, True)
        return diagonal + (ring_size - 1) * max(step, send)
