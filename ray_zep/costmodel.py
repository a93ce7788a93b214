"""FLOPs, bytes and times of the operations the planners and the simulator weigh.

Units: FLOPs, bytes, seconds, bytes/s. Times use the alpha-beta link model
(`latency + bytes / bandwidth`) and an attention throughput per GPU.

Compute rates (`ComputeRates`) come from `ray-zep bench calibrate`, which
measures the present device, or from the labelled hardware presets
(`HARDWARE_RATES`): the vendors' dense BF16 peaks (A800/A100 312 TFLOP/s,
H800/H100/H200 989 TFLOP/s: NVIDIA's A100 and H100/H200 SXM datasheets) times
efficiencies from published measurements.

Attention runs at a rate that depends on the length of the block a kernel call
computes per sequence: `rate(L) = rate_long x L / (L + L_half)`, where L_half is
the length at which the kernel reaches half its long-sequence rate. The form and
its constants fit the FlashAttention-2 benchmark (Dao-AILab/flash-attention,
`benchmarks/benchmark_flash_attention.py`: 16k tokens per batch cut into
sequences of 512 to 16k tokens, head dim 128, forward + backward; the README's
A100 and H100 figures) within 2%: on A100 the causal series levels at
193 TFLOP/s with L_half = 480, the unmasked one at 205 TFLOP/s with L_half = 185
(the causal diagonal tiles waste more on short blocks); on H100, 333 TFLOP/s with
L_half = 530 and 344 with 190. The forward / backward split takes FA2's Hopper
ratio of backward to forward rate at long sequences (0.87): A800 214 / 186
TFLOP/s (69% / 60% of peak), Hopper 350 / 327 (35% / 33%; the Zeppelin paper's
stack runs FlashAttention 2.4.3, which predates Hopper kernels). Dense matmuls
take 60% of peak, a little above the 52% model-FLOPs utilisation Megatron-LM
reports end to end on A100 (Narayanan et al., 2021). A virtual topology is
modelled as A800 nodes, so that plans made on a laptop look like plans made for
cluster A.

While communication kernels run on a GPU they take SMs from compute:
`ComputeRates.contention` slows the compute that overlaps a transfer. The
presets take 1.19, the mean slowdown of compute overlapped with NCCL
communication measured on A100 and H100 for GPT and LLaMA workloads
(arXiv 2507.03114, "Characterizing compute-communication overlap", 18.9% on
average, 40% at most). A ring step's send and receive, one grouped NCCL kernel, slow
it once (`ComputeRates.grouped_exchange`).

The crossover chunk length of a link is the Fig. 5 reading of the Zeppelin
paper: one ring step over a chunk of m tokens per rank computes an m x m block
(time proportional to m^2) while it sends the chunk's K and V (time
proportional to m). Past the crossover the transfer hides behind the compute.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from ray_zep.errors import ConfigError
from ray_zep.model_shapes import ModelShape
from ray_zep.topology import LinkKind, Topology

BYTES_PER_ELEMENT = 2
"""Activations travel in BF16."""
BACKWARD_ATTENTION_FACTOR = 2.5
"""Backward attention FLOPs over forward: five matmuls (S recomputed, dP, dS->dQ,
dK, dV) against the forward's two."""
BACKWARD_LINEAR_FACTOR = 2.0
"""Backward matmul FLOPs over forward: gradients of the input and of the weight."""
GRAD_BYTES_PER_ELEMENT = 4
"""Gradients are all-reduced in float32 (parameters are float32, autocast computes in bf16)."""


CURVE_KINDS = (
    "forward_causal",
    "forward_full",
    "backward_causal",
    "backward_full",
    "backward_autograd",
)
"""Attention block kinds a calibration measures: the diagonal blocks (causal) and a
ring step's other blocks (unmasked), forward and backward, and the backward of local
causal attention through autograd (whole-sequence placements; where not measured,
the engine's causal backward stands for it)."""


def pointwise_elements_per_token(shape: ModelShape) -> float:
    """Elements the element-wise work of one block touches per token, forward and backward:
    about 20 passes over the model dim (two RMSNorms, residual adds, RoPE on the
    heads; 4 of them the norms' backward working out their normalised input again) and
    8 over the feed-forward width (SwiGLU and its gradient, 2 of them working out silu
    again: `ray_zep.lean_ops`). An estimate; a calibration fits the rate on the
    model itself, which absorbs its error."""
    return 20.0 * shape.dim + 8.0 * shape.mean_ffn_params() / (3 * shape.dim)


@dataclass(frozen=True)
class ComputeRates:
    """Sustained compute of one GPU (or one CPU process of a virtual cluster).

    Attributes:
        attention_forward: FLOP/s of forward attention on long blocks, counting
            4 H E per visible (query, key) pair.
        attention_backward: FLOP/s of backward attention on long blocks, counting
            `BACKWARD_ATTENTION_FACTOR` times the forward FLOPs.
        matmul: FLOP/s of the linear modules (2 FLOPs per multiply-add).
        call_overhead_s: fixed seconds per attention kernel call (launch,
            metadata), paid once per ring step.
        source: where the numbers come from (preset and its sources, or the
            calibration run's device).
        causal_half_tokens: L_half of causal (diagonal) blocks: a block of L
            query tokens per sequence runs at `L / (L + L_half)` of the long rate.
        full_half_tokens: L_half of unmasked blocks (a ring step's other chunks).
        contention: compute time factor while a transfer shares the device (>= 1).
        grouped_exchange: how long a ring step's messages slow the compute beside them.
            True (the GPU presets): the rank's sends and receives in flight together
            count once, for the longer of the two directions (each direction's messages
            one after another). The engine posts a step's sends and receives as one
            batch (`batch_isend_irecv`); NCCL runs such a group as one kernel whose
            blocks split their warps between the sends and the receives
            (`src/device/sendrecv.h`), so both directions hold the same SMs. The
            presets' `contention` was measured over collectives that send and receive at
            once. False (a calibration): every message counts for its own time, as
            `bench calibrate` measures a CPU's, where gloo sends and receives on threads
            of their own.
        curves: measured attention rates replacing the half-rate form, per block
            kind (`CURVE_KINDS`): ((length, FLOP/s), ...) by increasing length,
            interpolated log-log and held flat outside (`ray-zep bench calibrate`).
        pointwise: elements/s of the element-wise work around the matmuls
            (norms, RoPE, activations, residual adds, the loss), counted as
            `pointwise_elements_per_token` per token and layer; 0: not modelled.
        optimizer_param_seconds: seconds of one optimizer update per parameter
            a rank owns (AdamW with its gradient clipping); 0: not modelled.
        step_overhead_s: fixed host-side seconds of every step (fetching the
            shard, the step's small collectives, its accounting); measured on a
            CPU virtual cluster, 0 in the GPU presets (a few ms against steps of
            seconds).
        fsdp_unit_overhead_s: seconds FSDP2 adds per unit and step beyond its
            modelled collectives (its hooks and buffer copies, and on a CPU virtual
            cluster its collectives' wait for ranks that drifted apart while
            computing); measured there, 0 in the GPU presets (they run on streams
            beside the compute).
        ring_row_seconds: seconds a ring step costs per query row besides its kernel
            (accumulators, copies); measured on the engine by a calibration, 0 in
            the GPU presets (fused into the kernels' epilogues there).
        codec_bytes_s: original bytes/s of the ZipCCL codec on one device, compress
            and decompress alike; 0: not measured, the simulator's default for the
            device (`ray_zep.sim.wire.codec_bytes_s`).
        curve_heads: query heads per kernel call the curves were measured with, where
            the kernel's rate follows the size of the score tensor it materializes
            (heads x queries x keys: the torch reference kernel of a CPU). A call
            with h heads (Ulysses leaves each rank H / U) is read at the length whose
            tensor is as large with `curve_heads`: length x sqrt(h / curve_heads).
            0: the rate follows the length alone (flash-attn works in tiles whatever
            the heads: the published curves, a calibration of flash-attn).
    """

    attention_forward: float
    attention_backward: float
    matmul: float
    call_overhead_s: float = 0.0
    source: str = ""
    causal_half_tokens: float = 0.0
    full_half_tokens: float = 0.0
    contention: float = 1.0
    curves: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    pointwise: float = 0.0
    optimizer_param_seconds: float = 0.0
    step_overhead_s: float = 0.0
    fsdp_unit_overhead_s: float = 0.0
    ring_row_seconds: float = 0.0
    codec_bytes_s: float = 0.0
    curve_heads: int = 0
    grouped_exchange: bool = False

    def __post_init__(self) -> None:
        rates = (self.attention_forward, self.attention_backward, self.matmul)
        if min(rates) <= 0 or self.call_overhead_s < 0:
            raise ValueError(f"compute rates must be > 0 (overhead >= 0), got {self}")
        if min(self.causal_half_tokens, self.full_half_tokens) < 0 or self.contention < 1:
            raise ValueError(f"half-rate lengths must be >= 0 and contention >= 1, got {self}")
        fixed = (
            self.optimizer_param_seconds,
            self.step_overhead_s,
            self.fsdp_unit_overhead_s,
            self.ring_row_seconds,
        )
        if min(self.pointwise, *fixed, self.curve_heads) < 0:
            raise ValueError(
                f"pointwise rate, fixed costs and curve_heads must be >= 0, got {self}"
            )
        for kind, points in self.curves:
            if kind not in CURVE_KINDS or not points or min(r for _, r in points) <= 0:
                raise ValueError(f"attention curve {kind!r} must be one of {CURVE_KINDS} "
                                 "with positive rates")  # fmt: skip

    def rate_curve(
        self, causal: bool, backward: bool, autograd: bool = False, heads: int = 0
    ) -> tuple[tuple[tuple[float, float], ...] | None, float]:
        """(the measured curve a block's rate is read from, None for the half-rate form;
        the factor its length is read at: `curve_heads`), see `attention_rates`."""
        kind = f"{'backward' if backward else 'forward'}_{'causal' if causal else 'full'}"
        kinds = ("backward_autograd", kind) if autograd and backward and causal else (kind,)
        curves = dict(self.curves)
        scale = math.sqrt(heads / self.curve_heads) if self.curve_heads and heads else 1.0
        return next((curves[name] for name in kinds if name in curves), None), scale

    def attention_rates(
        self,
        tokens: np.ndarray,
        causal: bool,
        backward: bool,
        autograd: bool = False,
        heads: int = 0,
    ) -> np.ndarray:
        """FLOP/s of blocks of `tokens` per sequence (an array; a measured curve where there
        is one, read log-log between its points and flat past its ends, else the half-rate
        form); `autograd`: local attention differentiated by autograd, not by the engine;
        `heads`: query heads of the call (0: as many as the curves were measured with, see
        `curve_heads`)."""
        curve, scale = self.rate_curve(causal, backward, autograd, heads)
        tokens = np.asarray(tokens, dtype=np.float64) * scale
        if curve is not None:
            log_tokens, log_rates = _log_curve(curve)
            logs = np.log(np.maximum(tokens, 1e-30))
            return np.exp(np.interp(logs, log_tokens, log_rates))
        rate = self.attention_backward if backward else self.attention_forward
        half = self.causal_half_tokens if causal else self.full_half_tokens
        safe = np.where(tokens > 0, tokens, 1.0)
        return rate * np.where(tokens > 0, safe / (safe + half), 1.0)

    def attention_rate(self, tokens: float, causal: bool, backward: bool, **call: int) -> float:
        """`attention_rates` of one block length (`call`: its `autograd` and `heads`)."""
        return float(self.attention_rates(tokens, causal, backward, **call))

    def attention_seconds(
        self, flops: float, tokens: float, causal: bool, backward: bool, **call: int
    ) -> float:
        """Seconds of `flops` attention FLOPs (forward-counted x `BACKWARD_ATTENTION_FACTOR`
        when `backward`) on blocks of `tokens` query tokens per sequence (unmasked
        blocks: the geometric mean of their query and key tokens), `call` as in
        `attention_rate`."""
        return flops / self.attention_rate(tokens, causal, backward, **call)

    def pointwise_seconds(self, elements: float) -> float:
        return elements / self.pointwise if self.pointwise > 0 else 0.0

    def scaled(self, share: float, note: str) -> ComputeRates:
        """These rates with every FLOP rate and the codec's rate times `share` (devices
        sharing a processor)."""
        return replace(
            self,
            attention_forward=self.attention_forward * share,
            attention_backward=self.attention_backward * share,
            matmul=self.matmul * share,
            source=f"{self.source}, {note}",
            curves=tuple(
                (kind, tuple((n, r * share) for n, r in points)) for kind, points in self.curves
            ),
            pointwise=self.pointwise * share,
            optimizer_param_seconds=self.optimizer_param_seconds / share,
            codec_bytes_s=self.codec_bytes_s * share,
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> ComputeRates:
        """Rates written by `ray-zep bench calibrate` (its `calibration.json`)."""
        try:
            data = json.loads(Path(path).read_text())
            known = {f.name: data[f.name] for f in fields(cls) if f.name in data}
            known["curves"] = tuple(
                (kind, tuple((float(n), float(r)) for n, r in points))
                for kind, points in known.get("curves", ())
            )
            return cls(**known)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--calibration {path}: not a calibration file ({exc})") from exc


CODEC_DRAM_FRACTION = 0.133
"""Share of a GPU's DRAM bandwidth our ZipCCL codec reaches, in the rule of
`codec_rule_bytes_s` (original bytes over 1 + 1 / ratio): its CUDA compress
measured on an H200, 374 GB/s of bf16 at 256 MiB a call (BENCHMARKS.md, fourth GPU
series; 372.5 in the sixth). Its decompress, about 600 GB/s there, is charged at the same
rate, and its host cost per call (40-47 us there) not at all. A calibration that timed
the codec on the GPU (`ray-zep bench calibrate`) replaces the rule."""
PAPER_CODEC_DRAM_FRACTION = 0.5
"""The share `ray-zep bench zipccl` assumes for ZipCCL's own kernels in the paper's
setups (a memory-bound kernel at half the DRAM bandwidth; `--codec-dram-fraction` varies
it)."""


def codec_rule_bytes_s(dram_bytes_s: float, ratio: float, fraction: float) -> float:
    """Original bytes/s a memory-bound codec compresses (and decompresses) on one GPU: a
    `fraction` of its DRAM bandwidth spent reading the original and writing the packed
    bytes (1 + 1 / `ratio` bytes moved per original byte)."""
    return fraction * dram_bytes_s / (1 + 1 / ratio)


ATTENTION_CALL_OVERHEAD_S = 10e-6
"""Launch and metadata cost of one varlen attention call on a GPU (typical CUDA
launch latencies are 5-10 us; the preset takes the upper end)."""

_DATASHEETS = "NVIDIA datasheet peak x efficiencies from FlashAttention-2 and Megatron-LM"
DATASHEET_PEAK_FLOPS = {"A800": 312e12, "H800": 989e12, "H200": 989e12}
"""Dense BF16 peak of one GPU (NVIDIA's A100 and H100/H200 SXM datasheets)."""
SM_CONTENTION = 1.19
"""Compute slowdown under overlapped NCCL kernels (arXiv 2507.03114, mean of A100/H100)."""
AMPERE_HALF_TOKENS = (480.0, 185.0)
HOPPER_HALF_TOKENS = (530.0, 190.0)
"""(causal, unmasked) L_half of FlashAttention-2 at head dim 128 (module docstring)."""


def _gpu_rates(gpu: str, forward: float, backward: float, half: tuple[float, float]):
    peak = DATASHEET_PEAK_FLOPS[gpu]
    return ComputeRates(
        forward,
        backward,
        peak * 0.60,
        ATTENTION_CALL_OVERHEAD_S,
        f"{gpu} preset: {_DATASHEETS}",
        *half,
        SM_CONTENTION,
        grouped_exchange=True,
    )


HARDWARE_RATES: dict[str, ComputeRates] = {
    "A800": _gpu_rates("A800", 214e12, 186e12, AMPERE_HALF_TOKENS),
    "H800": _gpu_rates("H800", 350e12, 327e12, HOPPER_HALF_TOKENS),
    "H200": _gpu_rates("H200", 350e12, 327e12, HOPPER_HALF_TOKENS),
    "A10G": ComputeRates(
        40e12,
        40e12,
        50e12,
        30e-6,
        "A10G assumption (FoldMoE testbed): 50 / 40 TFLOP/s fp16 matmul / flash attention "
        "achieved, 30 us per kernel step (launches, permutations); not measured",
    ),
}
"""Labelled presets (see the module docstring for the sources)."""
HARDWARE_ALIASES = {"A100": "A800", "H100": "H800"}


def _known_gpu(gpu_model: str) -> str | None:
    """The preset key of a GPU named like `NVIDIA H100 80GB HBM3` or `A800-80G`."""
    name = gpu_model.upper()
    for key in (*HARDWARE_RATES, *HARDWARE_ALIASES):
        if key in name:
            return HARDWARE_ALIASES.get(key, key)
    return None


def datasheet_peak_flops(gpu_model: str) -> float | None:
    """Dense BF16 peak of a named GPU (None: not known)."""
    known = _known_gpu(gpu_model)
    return DATASHEET_PEAK_FLOPS.get(known) if known else None


def preset_gpu(gpu_model: str) -> str:
    """The GPU whose rates `preset_rates` takes for `gpu_model` (A800 when unknown)."""
    return _known_gpu(gpu_model) or "A800"


def known_rates(gpu_model: str) -> ComputeRates | None:
    """The preset of a named GPU; None where none is known (a CPU, another GPU)."""
    known = _known_gpu(gpu_model)
    return HARDWARE_RATES[known] if known else None


def preset_rates(gpu_model: str) -> ComputeRates:
    """The preset of a named GPU (A800 otherwise)."""
    return HARDWARE_RATES[preset_gpu(gpu_model)]


def linear_flops_per_token(shape: ModelShape) -> tuple[float, float]:
    """Forward FLOPs of one block's matmuls for one token, one layer: (before
    attention: Q, K, V projections; after it: output projection and SwiGLU MLP, or
    an MoE block's gate and top-k experts, averaged over the blocks)."""
    e = shape.head_dim
    before = 2.0 * shape.dim * (shape.n_heads + 2 * shape.n_kv_heads) * e
    after = output_projection_flops_per_token(shape) + 2.0 * shape.mean_ffn_params()
    return before, after


def output_projection_flops_per_token(shape: ModelShape) -> float:
    """Forward FLOPs of the attention output projection for one token, one layer (part
    of `linear_flops_per_token`'s after)."""
    return 2.0 * shape.n_heads * shape.head_dim * shape.dim


def head_flops_per_token(shape: ModelShape) -> float:
    """Forward FLOPs of the LM head for one token (the embedding is a lookup)."""
    return 2.0 * shape.vocab_size * shape.dim


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
        collective_step: (latency s, bytes/s) of one step of a ring collective when it
            was measured apart from point-to-point messages (a CPU virtual cluster's
            calibration); None: the topology's links.
        message_latency: (seconds a rank computes while a ring message is in flight,
            the message's latency) in rising compute: on a CPU virtual cluster, whose
            ranks time-slice the cores, a message waits longer for a peer that computed
            longer (`ray_zep.bench.calibrate_links`); empty: the topology's latency.
    """

    shape: ModelShape
    topology: Topology
    attention_flops_per_s: float
    collective_step: tuple[float, float] | None = None
    message_latency: tuple[tuple[float, float], ...] = ()

    @classmethod
    def create(cls, shape: ModelShape, topology: Topology) -> CostModel:
        return cls(shape, topology, preset_rates(topology.gpu_model).attention_forward)

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

    def ring_message_seconds(self, nbytes: float, kind: LinkKind, compute_s: float) -> float:
        """A ring message of `nbytes` across one hop, in flight while its ranks compute
        `compute_s`: at the latency `message_latency` gives for that compute (linear
        between its points, its ends beyond them), the topology's where it is empty."""
        if nbytes <= 0 or not self.message_latency:
            return self.transfer_seconds(nbytes, kind, one_sender_per_nic=True)
        computes, latencies = zip(*self.message_latency, strict=True)
        latency = float(np.interp(compute_s, computes, latencies))
        return latency + nbytes / self.link_bandwidth(kind, one_sender_per_nic=True)

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

    def bus_bandwidth(self, ranks) -> float:
        """Per-rank bandwidth of a ring collective over `ranks` (bytes/s).

        Inside one node: a GPU's intra-node port. Across nodes NCCL runs one ring
        per NIC, so a node's NICs together carry what its GPUs exchange, capped by
        the intra-node port (the "bus bandwidth" of nccl-tests).
        """
        if self.collective_step is not None:
            return self.collective_step[1]
        topo = self.topology
        if len({topo.node_of(r) for r in ranks}) <= 1:
            return topo.intra_node_bandwidth
        return min(topo.intra_node_bandwidth, topo.nics_per_node * topo.nic_bandwidth)

    def ring_latency(self, ranks, steps: int, crossings: int) -> float:
        """Latency of `steps` ring steps over `ranks`, `crossings` of them between nodes
        (per crossing per pass of the data round the ring). A ring collective orders its
        ranks node by node, so only the hops that leave a node wait on the network; the
        others go at the intra-node latency. This is NCCL's own model of a ring's latency
        (`src/graph/tuning.cc`: (nsteps - nInterSteps) x intra + nInterSteps x inter, with
        nInterSteps = nNodes - 1 for all-gather and reduce-scatter, 2 (nNodes - 1) for
        all-reduce). A measured `collective_step` charges its latency to every step."""
        if self.collective_step is not None:
            return steps * self.collective_step[0]
        return ring_steps_latency(self.topology, ranks, steps, crossings)

    def all_gather_seconds(self, block_bytes: float, ranks) -> float:
        """All-gather (or reduce-scatter) of one `block_bytes` block per rank: W - 1
        ring steps, each rank receiving W - 1 blocks at the bus bandwidth; the latency
        of `ring_latency` (one pass)."""
        steps = len(ranks) - 1
        if steps <= 0:
            return 0.0
        return self.ring_latency(ranks, steps, 1) + steps * block_bytes / self.bus_bandwidth(ranks)

    def all_reduce_seconds(self, nbytes: float, ranks) -> float:
        """Ring all-reduce of `nbytes` per rank: 2 (W - 1) steps moving 2 (W - 1) / W of it
        (two passes of `ring_latency`)."""
        world = len(ranks)
        if world <= 1:
            return 0.0
        volume = 2 * (world - 1) / world * nbytes
        steps = 2 * (world - 1)
        return self.ring_latency(ranks, steps, 2) + volume / self.bus_bandwidth(ranks)


@functools.lru_cache(maxsize=64)
def _log_curve(curve: tuple[tuple[float, float], ...]) -> tuple[np.ndarray, np.ndarray]:
    """A measured rate curve's (log tokens, log FLOP/s), read once per curve: the planners
    read rates dozens of times a step."""
    points = np.asarray(curve, dtype=np.float64)
    return np.log(points[:, 0]), np.log(points[:, 1])


def ring_steps_latency(topology: Topology, ranks, steps: int, crossings: int) -> float:
    """`CostModel.ring_latency` at the topology's own latencies."""
    nodes = len({topology.node_of(r) for r in ranks})
    if nodes <= 1:
        return steps * topology.intra_node_latency
    inter = min(steps, crossings * (nodes - 1))
    return (steps - inter) * topology.intra_node_latency + inter * topology.inter_node_latency
