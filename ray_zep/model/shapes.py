"""Model shapes and presets, usable without materialising any weights.

The Zeppelin paper trains LLaMA models with multi-head attention at 3B, 7B, 13B
and 30B without listing their dimensions; the presets use the published LLaMA
shapes of those sizes: 7B and 13B from LLaMA / LLaMA-2, 30B from LLaMA's 32.5B
("30B") model, and 3B from OpenLLaMA-3B, all with a 32000-token vocabulary.
`tiny` is the CPU demo model (byte-level vocabulary, GQA with 2 KV heads).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ray_zep.config import ModelConfig
from ray_zep.errors import ConfigError


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
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
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

    @property
    def head_dim(self) -> int:
        """E, the dimension of one attention head."""
        return self.dim // self.n_heads

    def linear_params_per_layer(self) -> int:
        """Weights of one block's matmuls (QKV, output, SwiGLU)."""
        e = self.head_dim
        attn = self.dim * (self.n_heads * e) * 2 + self.dim * (self.n_kv_heads * e) * 2
        return attn + 3 * self.dim * self.ffn_dim

    def param_count(self) -> int:
        """All parameters: untied input/output embeddings, blocks, norms."""
        per_layer = self.linear_params_per_layer() + 2 * self.dim
        return 2 * self.vocab_size * self.dim + self.n_layers * per_layer + self.dim

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs of every matmul for one token (2 per multiply-add)."""
        return 2.0 * (self.n_layers * self.linear_params_per_layer() + self.vocab_size * self.dim)

    def attention_flops(self, seq_len: int, causal: bool = True) -> float:
        """Forward FLOPs of the score and value matmuls of one sequence, all layers."""
        full = 4.0 * seq_len * seq_len * self.n_heads * self.head_dim * self.n_layers
        return full / 2 if causal else full

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352),
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


def build_shape(cfg: ModelConfig) -> ModelShape:
    """The preset named by `model.preset` with the explicitly set fields replaced.

    Raises:
        ConfigError: unknown preset or inconsistent dimensions.
    """
    if cfg.preset not in PRESETS:
        raise ConfigError(
            f"config key model.preset={cfg.preset!r}: choose one of {', '.join(PRESETS)}"
        )
    return replace(PRESETS[cfg.preset], **cfg.overrides())
