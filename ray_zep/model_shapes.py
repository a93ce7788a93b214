"""Model shapes and presets, usable without materialising any weights.

The Zeppelin paper trains LLaMA models with multi-head attention at 3B, 7B, 13B
and 30B without listing their dimensions; the presets use the published LLaMA
shapes of those sizes: 7B and 13B from LLaMA / LLaMA-2, 30B from LLaMA's 32.5B
("30B") model, and 3B from OpenLLaMA-3B, all with a 32000-token vocabulary.
`tiny` is the CPU demo model (byte-level vocabulary, GQA with 2 KV heads).

MoE presets replace the feed-forward of some blocks by `moe_experts` SwiGLU
experts. `gpt_moe_s/m/l` carry the GPT-MoE shapes of the FoldMoE paper's
Table 1 (d_model 512/768/1024, 8 heads, 6/6/12 blocks, expert hidden size
2·d_model, every other block MoE, top-1 gate, capacity factor 1.0, 16 experts:
one per GPU of its 16-GPU testbed) on this LLaMA-style block, with GPT-2's
vocabulary and 4·d_model dense feed-forwards. The Zeppelin paper's `8x550m`
does not list its dimensions; the preset takes a 550M LLaMA shape (d 1536,
16 blocks, 12 heads, SwiGLU 4096, ≈551M parameters with one expert) with 8
such experts in every block and a top-2 gate. `tiny_moe` is `tiny` with 4
experts in every other block (top-2), for CPU runs.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from ray_zep.errors import ConfigError
from ray_zep.hf_config import SHAPE_KEYS, hf_shape_fields


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a LLaMA-style decoder.

    Attributes:
        vocab_size: V, token ids are in [0, V).
        dim: D, model (hidden) dimension.
        n_layers: number of transformer blocks.
        n_heads: H, query heads.
        n_kv_heads: K, key/value heads (GQA when K < H).
        ffn_dim: F, SwiGLU inner dimension.
        rope_theta: RoPE base.
        norm_eps: RMSNorm epsilon.
        moe_experts: X, experts per MoE block; 0 = a dense model.
        moe_top_k: experts per token (1 or 2).
        moe_capacity_factor: expert slots = ceil(CF · K · T / X) per routing
            group (a rank's tokens); <= 0: no token is ever dropped.
        moe_hidden: each expert's SwiGLU inner dimension; 0 = ffn_dim.
        moe_every: every n-th block is an MoE block (blocks n-1, 2n-1, ...).
        qkv_bias: the query, key and value projections carry a bias (Qwen2);
            the output projection never does.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    moe_experts: int = 0
    moe_top_k: int = 1
    moe_capacity_factor: float = 1.0
    moe_hidden: int = 0
    moe_every: int = 1
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        self._check_moe()
        for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key model.{key}={getattr(self, key)}: must be >= 1")
        if self.dim % self.n_heads:
            raise ConfigError(
                f"config key model.dim={self.dim}: must be divisible by "
                f"model.n_heads={self.n_heads}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"config key model.n_kv_heads={self.n_kv_heads}: must divide "
                f"model.n_heads={self.n_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model.dim / model.n_heads = {self.head_dim} must be even for RoPE")

    def _check_moe(self) -> None:
        if self.moe_experts < 0:
            raise ConfigError(f"config key model.moe.num_experts={self.moe_experts}: must be >= 0")
        if self.moe_experts and not 1 <= self.moe_top_k <= min(2, self.moe_experts):
            raise ConfigError(
                f"config key model.moe.top_k={self.moe_top_k}: must be 1 or 2 "
                f"(and at most model.moe.num_experts={self.moe_experts})"
            )
        if self.moe_every < 1 or self.moe_hidden < 0:
            raise ConfigError(
                f"config keys model.moe.every={self.moe_every} / model.moe.hidden_dim="
                f"{self.moe_hidden}: every must be >= 1, hidden_dim >= 0"
            )

    def ulysses_fault(self, degree: int) -> str | None:
        """Why Ulysses over `degree` members cannot split the heads (the CP seed's rules:
        U divides H, and K divides U or U divides K), or None where it can."""
        heads, kv = self.n_heads, self.n_kv_heads
        if heads % degree:
            return f"Ulysses over {degree} ranks needs model.n_heads={heads} divisible by {degree}"
        if degree > kv and degree % kv:
            return (
                f"Ulysses over {degree} ranks with model.n_kv_heads={kv} "
                f"needs {degree} divisible by {kv}"
            )
        if degree <= kv and kv % degree:
            return f"Ulysses over {degree} ranks needs model.n_kv_heads={kv} divisible by {degree}"
        return None

    def is_moe_block(self, index: int) -> bool:
        """Whether block `index` (0-based) is an MoE block."""
        return self.moe_experts > 0 and index % self.moe_every == self.moe_every - 1

    @property
    def moe_blocks(self) -> int:
        return sum(self.is_moe_block(i) for i in range(self.n_layers))

    @property
    def expert_hidden(self) -> int:
        """F of one expert."""
        return self.moe_hidden or self.ffn_dim

    @property
    def head_dim(self) -> int:
        """E, the dimension of one attention head."""
        return self.dim // self.n_heads

    def attention_params_per_layer(self) -> int:
        """Weights of one block's Q, K, V and output projections."""
        e = self.head_dim
        biases = (self.n_heads + 2 * self.n_kv_heads) * e if self.qkv_bias else 0
        return self.dim * (self.n_heads * e) * 2 + self.dim * (self.n_kv_heads * e) * 2 + biases

    def linear_params_per_layer(self) -> int:
        """Weights one token meets in a dense block's matmuls (QKV, output, SwiGLU)."""
        return self.attention_params_per_layer() + 3 * self.dim * self.ffn_dim

    def active_params_per_layer(self, index: int) -> int:
        """Matmul weights one token meets in block `index` (its top-k experts and the gate)."""
        if not self.is_moe_block(index):
            return self.linear_params_per_layer()
        experts = self.moe_top_k * 3 * self.dim * self.expert_hidden
        return self.attention_params_per_layer() + experts + self.dim * self.moe_experts

    def mean_ffn_params(self) -> float:
        """Feed-forward (or gate + top-k experts) weights one token meets, averaged over blocks."""
        attention = self.attention_params_per_layer()
        active = sum(self.active_params_per_layer(i) - attention for i in range(self.n_layers))
        return active / self.n_layers

    def param_count(self) -> int:
        """All parameters: untied input/output embeddings, blocks (every expert), norms."""
        return _param_count(self)

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs of every matmul for one token (2 per multiply-add)."""
        blocks = sum(self.active_params_per_layer(i) for i in range(self.n_layers))
        return 2.0 * (blocks + self.vocab_size * self.dim)

    def attention_flops(self, seq_len: int, causal: bool = True) -> float:
        """Forward FLOPs of the score and value matmuls of one sequence, all layers."""
        full = 4.0 * seq_len * seq_len * self.n_heads * self.head_dim * self.n_layers
        return full / 2 if causal else full

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@functools.lru_cache(maxsize=256)
def _param_count(shape: ModelShape) -> int:
    """`ModelShape.param_count`, worked out once per shape (the memory model asks for it
    for every rank it models)."""
    total = 2 * shape.vocab_size * shape.dim + shape.dim
    for index in range(shape.n_layers):
        total += shape.active_params_per_layer(index) + 2 * shape.dim
        if shape.is_moe_block(index):
            total += (shape.moe_experts - shape.moe_top_k) * 3 * shape.dim * shape.expert_hidden
    return total


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352),
    "tiny_moe": ModelShape(
        vocab_size=256,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=352,
        moe_experts=4,
        moe_top_k=2,
        moe_capacity_factor=1.25,
        moe_hidden=176,
        moe_every=2,
    ),
    **{
        f"gpt_moe_{size}": ModelShape(
            vocab_size=50257,
            dim=dim,
            n_layers=layers,
            n_heads=8,
            n_kv_heads=8,
            ffn_dim=4 * dim,
            moe_experts=16,
            moe_top_k=1,
            moe_capacity_factor=1.0,
            moe_hidden=2 * dim,
            moe_every=2,
        )
        for size, dim, layers in (("s", 512, 6), ("m", 768, 6), ("l", 1024, 12))
    },
    "8x550m": ModelShape(
        vocab_size=32000,
        dim=1536,
        n_layers=16,
        n_heads=12,
        n_kv_heads=12,
        ffn_dim=4096,
        moe_experts=8,
        moe_top_k=2,
        moe_capacity_factor=1.0,
        moe_hidden=4096,
        moe_every=1,
    ),
    "3b": ModelShape(
        vocab_size=32000, dim=3200, n_layers=26, n_heads=32, n_kv_heads=32, ffn_dim=8640
    ),
    "7b": ModelShape(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008
    ),
    "13b": ModelShape(
        vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824
    ),
    "30b": ModelShape(
        vocab_size=32000, dim=6656, n_layers=60, n_heads=52, n_kv_heads=52, ffn_dim=17920
    ),
}


class MoESpec(Protocol):
    def overrides(self) -> dict[str, Any]: ...


class ShapeSpec(Protocol):
    """What `build_shape` reads: the `model` section of the config (`ModelConfig`)."""

    preset: str
    init_from: str | None
    moe: MoESpec

    def overrides(self) -> dict[str, Any]: ...


def build_shape(cfg: ShapeSpec) -> ModelShape:
    """The model's shape: the preset named by `model.preset`, or the Hugging Face
    checkpoint of `model.init_from`, with the explicitly set fields replaced.

    Under `model.init_from` the checkpoint's config.json fixes the shape (the preset
    is not used): an explicit size key may only repeat its value, and MoE keys
    may only keep the model dense.

    Raises:
        ConfigError: unknown preset, unreadable or unsupported checkpoint, a key
            that contradicts the checkpoint, or inconsistent dimensions.
    """
    init_from = getattr(cfg, "init_from", None)
    if init_from:
        return _checkpoint_shape(init_from, {**cfg.overrides(), **cfg.moe.overrides()})
    if cfg.preset not in PRESETS:
        raise ConfigError(
            f"config key model.preset={cfg.preset!r}: choose one of {', '.join(PRESETS)}"
        )
    return replace(PRESETS[cfg.preset], **cfg.overrides(), **cfg.moe.overrides())


MOE_KEYS = {
    "moe_experts": "moe.num_experts",
    "moe_top_k": "moe.top_k",
    "moe_capacity_factor": "moe.capacity_factor",
    "moe_hidden": "moe.hidden_dim",
    "moe_every": "moe.every",
}


def _checkpoint_shape(init_from: str, overrides: dict[str, Any]) -> ModelShape:
    """The shape of the checkpoint at `init_from`; `overrides` must agree with it."""
    fields = hf_shape_fields(init_from)
    for name, value in overrides.items():
        if name in MOE_KEYS:
            if name == "moe_experts" and value:
                raise ConfigError(
                    f"config key model.moe.num_experts={value} conflicts with "
                    f"model.init_from={init_from!r}: a dense checkpoint (Llama / Qwen2)"
                )
            continue
        if name in fields and fields[name] != value:
            raise ConfigError(
                f"config key model.{name}={value} conflicts with {SHAPE_KEYS[name]}="
                f"{fields[name]} in {init_from}/config.json (model.init_from); drop the key "
                "or give the checkpoint's value"
            )
    return ModelShape(**fields)
