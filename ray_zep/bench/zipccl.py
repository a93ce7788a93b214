"""`ray-zep bench zipccl`: an analytic, modelled step of ZipCCL's paper setups, off and on.

For each setup of the ZipCCL paper's evaluation (the ZipCCL paper,
§6; "§" below names the paper's sections) the model computes one training step
per GPU, with NCCL's collectives and with ZipCCL's zipped ones:

- compute: model FLOPs (PaLM appendix B convention, as TorchTitan's model args
  count them: 6 x matmul params + 12 x layers x heads x head dim x seq per
  token) over peak BF16 rate x `mfu`;
- FSDP (Llama3-8B, TorchTitan): FSDP2 units = embedding, each block, final
  norm + output. Forward all-gathers every unit in BF16; backward re-gathers
  all but norm + output (TorchTitan's default reshard_after_forward, see
  `apply_fsdp` in torchtitan/models/llama3/infra/parallelize.py) and
  reduce-scatters gradients in FP32 (`reduce_dtype` from
  `training.mixed_precision_reduce`, default "float32",
  torchtitan/config/job_config.py). One communication stream, one compute
  stream: a unit's gather is issued when the previous unit's compute starts
  (prefetch of one), its reduce-scatter when its backward ends; a compute
  waits for its gather. Exposed communication is what this leaves past the
  compute.
- EP MoE (DeepSeek-V3, Qwen3-MoE, Megatron-LM, DP = EP = GPUs, §6.2):
  per MoE layer a dispatch and a combine all-to-all forward and the same two
  backward, each GPU sending every token once per routed expert (top-k
  copies, BF16), with uniform routing. They are on the critical path
  (Megatron's alltoall dispatcher without its optional comm overlap). The
  non-expert gradients are all-reduced across DP in FP32 (Megatron forces
  FP32 grad all-reduce for BF16, megatron/training/arguments.py) after the
  backward, not overlapped (`--overlap-grad-reduce` is off by default).
- links: only the inter-node link is modelled (one NIC per node at the
  paper's line rate, §6.1). Ring all-gather / reduce-scatter of S bytes:
  (N-1) x alpha + (N-1)/N x S / NIC; all-to-all of b bytes per GPU: alpha +
  g x b x (N-g)/N / NIC (g GPUs per node share the NIC; intra-node traffic is
  free).
- ZipCCL: wire bytes = raw / ratio, the ratio measured by our codec on this
  machine (`zipccl_report.py`), plus compress + decompress time serial with the
  transfer, at a codec rate = `codec_dram_fraction` x DRAM bandwidth / (1 +
  1/ratio) (the kernel reads the original and writes the packed bytes; the
  paper gives its kernel speed only as a figure, Fig. 12, no number in the
  text). FSDP reduce-scatter: the paper's adaptive switcher (§5.2) picks per
  unit the faster of the native FP32 ring and the zipped BF16 all-to-all +
  local reduce (§6.3: on its platform the native one won). All-gathers
  and all-to-alls likewise fall back to the plain collective where the zipped
  one is modelled slower (as our own switcher does; at ratio 1.0 the step is
  then NCCL's exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_zep.costmodel import PAPER_CODEC_DRAM_FRACTION
from ray_zep.errors import ConfigError


@dataclass(frozen=True)
class PaperCluster:
    """A cluster of the paper. Rates: Gb/s line rate per node, dense BF16 TFLOP/s, DRAM GB/s."""

    name: str
    gpus_per_node: int
    nic_gbps: float
    peak_tflops: float
    dram_gbytes_s: float

    @property
    def nic_bytes_s(self) -> float:
        return self.nic_gbps * 1e9 / 8


A6000 = PaperCluster("RTX A6000, 200 Gb/s", 8, 200.0, 154.8, 768.0)
"""§6.1; 8 GPUs per node (§6.1; "four nodes" there cannot hold 64 GPUs, so the model
takes as many nodes of 8 as the GPU count needs). RTX A6000 datasheet: 154.8 TFLOP/s
dense BF16 tensor (309.7 with sparsity), 768 GB/s GDDR6."""
H800 = PaperCluster("H800, 400 Gb/s", 8, 400.0, 989.4, 3350.0)
"""§6.1, §6.2; 8 GPUs per node assumed. H800 SXM keeps H100 SXM's 989.4 TFLOP/s dense
BF16 and 3.35 TB/s HBM3 (its NVLink is cut, which this model does not use)."""


@dataclass(frozen=True)
class DenseModel:
    """A Llama-style dense decoder (element counts, no bias)."""

    name: str
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def block_params(self) -> int:
        kv = self.kv_heads * self.head_dim
        return 2 * self.dim * self.dim + 2 * self.dim * kv + 3 * self.dim * self.ffn + 2 * self.dim

    def unit_params(self) -> list[int]:
        """Parameters of each FSDP unit in forward order: embedding, blocks, norm + output."""
        return [self.vocab * self.dim, *[self.block_params()] * self.layers,
                self.vocab * self.dim + self.dim]  # fmt: skip

    def unit_flops_per_token(self, seq_len: int) -> list[float]:
        """Training FLOPs per token of each FSDP unit (the embedding lookup has none)."""
        attention = 12 * self.heads * self.head_dim * seq_len
        block = 6 * self.block_params() + attention
        return [0.0, *[float(block)] * self.layers, 6.0 * self.vocab * self.dim]


@dataclass(frozen=True)
class MoEModel:
    """An MoE decoder with every block MoE, as trained with DP = EP (element counts)."""

    name: str
    vocab: int
    dim: int
    layers: int
    attention_params: int
    attention_width: int
    """heads x mean of the q.k and v head dims: the attention FLOP term's h x q."""
    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int

    def expert_params(self) -> int:
        return 3 * self.dim * self.expert_ffn

    def replicated_params(self) -> int:
        """Non-expert parameters (DP-replicated, their gradients all-reduced every step)."""
        per_layer = self.attention_params + self.shared_experts * self.expert_params()
        per_layer += self.dim * self.experts + 2 * self.dim  # router, norms
        return self.layers * per_layer + 2 * self.vocab * self.dim + self.dim

    def flops_per_token(self, seq_len: int) -> float:
        active = self.attention_params + (self.top_k + self.shared_experts) * self.expert_params()
        active += self.dim * self.experts
        matmul = self.layers * active + self.vocab * self.dim
        return 6.0 * matmul + 12.0 * self.layers * self.attention_width * seq_len


LLAMA3_8B = DenseModel("Llama3-8B", 128256, 4096, 32, 32, 8, 14336)
"""meta-llama/Meta-Llama-3-8B config.json; 8.03e9 parameters."""


def _mla_params(dim: int, heads: int, q_rank: int, kv_rank: int, nope: int, rope: int, v: int):
    """DeepSeek multi-head latent attention: q down/up, kv down (+ rope key)/up, output."""
    q = dim * q_rank + q_rank * heads * (nope + rope)
    kv = dim * (kv_rank + rope) + kv_rank * heads * (nope + v)
    return q + kv + heads * v * dim + q_rank + kv_rank


DEEPSEEK_V3_REDUCED = MoEModel(
    "DeepSeek-V3 (64 experts, 4 layers)", 129280, 7168, 4,
    _mla_params(7168, 128, 1536, 512, 128, 64, 128), 128 * (128 + 64 + 128) // 2,
    64, 8, 2048, 1,
)  # fmt: skip
"""deepseek-ai/DeepSeek-V3 config.json with 64 experts and 4 layers (§6.1); all 4 layers
MoE (the config's first 3 dense layers would leave one MoE layer; the paper does not say)."""
QWEN3_MOE_REDUCED = MoEModel(
    "Qwen3-MoE (128 experts, 16 layers)", 151936, 4096, 16,
    4096 * 64 * 128 * 2 + 4096 * 4 * 128 * 2 + 2 * 128, 64 * 128,
    128, 8, 1536, 0,
)  # fmt: skip
"""Qwen/Qwen3-235B-A22B config.json (64 q / 4 kv heads of 128, 128 experts, top-8, expert
ffn 1536) with 16 layers (§6.1)."""


@dataclass(frozen=True)
class Setup:
    """One paper case: model, testbed, GPUs and the paper's speedups (None: not stated)."""

    model: DenseModel | MoEModel
    testbed: PaperCluster
    gpus: int
    paper_e2e: float | None
    paper_comm: float | None
    approximate: bool
    """The paper's text gives the figure as "around" / "near" / "approximately"."""
    source: str

    @property
    def name(self) -> str:
        return f"{self.model.name.split(' ')[0]} {self.gpus}x{self.testbed.name.split(',')[0]}"


SETUPS: tuple[Setup, ...] = (
    Setup(LLAMA3_8B, A6000, 16, 1.18, 1.34, True, "§6.2 (near 1.18), §6.3 (about 1.34)"),
    Setup(LLAMA3_8B, A6000, 32, 1.18, 1.34, True, "§6.2, §6.3"),
    Setup(LLAMA3_8B, A6000, 64, 1.18, 1.35, False, "§6.2 (1.18), §6.3 (1.35)"),
    Setup(DEEPSEEK_V3_REDUCED, A6000, 16, 1.06, 1.17, False, "§6.2, §6.3"),
    Setup(DEEPSEEK_V3_REDUCED, A6000, 32, None, None, False, "not stated in the text"),
    Setup(DEEPSEEK_V3_REDUCED, A6000, 64, 1.16, 1.25, False, "§6.2, §6.3, §6.3"),
    Setup(QWEN3_MOE_REDUCED, A6000, 16, 1.16, 1.25, True, "§6.2 (around 1.16), §6.3"),
    Setup(QWEN3_MOE_REDUCED, A6000, 32, 1.16, 1.25, True, "§6.2, §6.3"),
    Setup(QWEN3_MOE_REDUCED, A6000, 64, 1.16, 1.24, False, "§6.2 (1.16), §6.3 (1.24)"),
    Setup(QWEN3_MOE_REDUCED, H800, 16, 1.13, None, False, "§6.2"),
    Setup(LLAMA3_8B, H800, 16, 1.13, None, False, "§6.2"),
)
"""Micro-batch 1 x 1024 tokens per GPU (§6.1); one micro-batch per step (assumed)."""


@dataclass(frozen=True)
class Ratios:
    """Measured compression ratios (original / wire bytes) of each kind of payload."""

    weights: float
    """FSDP all-gather: BF16 weights of a freshly initialised layer."""
    activations: float
    """MoE forward dispatch / combine: BF16 hidden states."""
    gradients: float
    """MoE backward all-to-alls and the zipped reduce-scatter: BF16 gradients."""

    def __post_init__(self) -> None:
        for key in ("weights", "activations", "gradients"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"ratio {key}={getattr(self, key)}: must be > 0")


@dataclass(frozen=True)
class Assumptions:
    """The model's free parameters, each stated in the README section."""

    mfu: float = 0.58
    """Model FLOPs / peak: TorchTitan's Llama3-8B FSDP figure (docs/performance.md, 64 A100,
    local batch 1, selective op AC: 58.2%)."""
    codec_dram_fraction: float = PAPER_CODEC_DRAM_FRACTION
    """Share of DRAM bandwidth ZipCCL's own codec kernels reach (assumed: the paper gives
    no number; ours, measured on an H200, reach `ray_zep.costmodel.CODEC_DRAM_FRACTION`)."""
    latency_us: float = 10.0
    """Alpha per inter-node ring step (`inter_latency_us` default of ray_zep.topology)."""
    seq_len: int = 1024
    micro_batches: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1:
            raise ConfigError(f"bench zipccl --mfu={self.mfu}: must be in (0, 1]")
        if not 0 < self.codec_dram_fraction <= 1:
            raise ConfigError(
                f"bench zipccl --codec-dram-fraction={self.codec_dram_fraction}: must be in (0, 1]"
            )
        if self.latency_us < 0 or self.seq_len < 1 or self.micro_batches < 1:
            raise ConfigError(
                f"bench zipccl: latency_us={self.latency_us} must be >= 0, seq_len="
                f"{self.seq_len} and micro_batches={self.micro_batches} >= 1"
            )


def check_gpus(setup: Setup) -> int:
    """Nodes of a setup; raises ConfigError unless it spans >= 2 whole nodes."""
    nodes, rest = divmod(setup.gpus, setup.testbed.gpus_per_node)
    if rest or nodes < 2:
        raise ConfigError(
            f"{setup.name}: {setup.gpus} GPUs must be >= 2 whole nodes of "
            f"{setup.testbed.gpus_per_node} (only the inter-node link is modelled)"
        )
    return nodes
