"""The model shape of a Hugging Face checkpoint directory (`model.init_from`).

Reads `config.json` of a `LlamaForCausalLM` or `Qwen2ForCausalLM` checkpoint and
returns the `ModelShape` fields it fixes, by shape name. It only parses JSON (no
weights, no `transformers`), so `build_shape` can call it wherever a shape is
needed; `ray_zep.model.hf` reads and writes the weights.

What the LLaMA-style block here computes is checked against the file, and
anything else is refused with the key and the path: an activation other than
SiLU, a head dimension other than hidden_size / num_attention_heads, RoPE
scaling, a bias on the MLP (or, for Llama, on the attention projections), and
Qwen2's sliding window. Qwen2 always carries a bias on q_proj, k_proj and v_proj
(`qkv_bias`), none on o_proj. Tied input and output embeddings are reported
(`tied`) but are not a shape field: `ray_zep.model.hf` loads them untied.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from ray_zep.errors import ConfigError

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
"""The `architectures` entries a checkpoint may carry."""

SHAPE_KEYS = {
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
}
"""ModelShape field -> config.json key."""

CONFIG_FILE = "config.json"
INIT_KEY = "model.init_from"


@functools.lru_cache(maxsize=8)
def _read(path: str, stamp: tuple[int, int]) -> dict[str, Any]:
    del stamp  # part of the cache key: a rewritten config.json is read again
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"config key {INIT_KEY}: {path} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config key {INIT_KEY}: {path} does not hold a JSON object")
    return data


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    """The parsed `config.json` of a checkpoint directory.

    Raises:
        ConfigError: the directory or its config.json is missing or not JSON.
    """
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(
            f"config key {INIT_KEY}={str(directory)!r}: no {CONFIG_FILE} at {path}; give a "
            "Hugging Face checkpoint directory (config.json + *.safetensors)"
        )
    stat = path.stat()
    return _read(str(path), (stat.st_mtime_ns, stat.st_size))


def architecture(config: dict[str, Any], where: str) -> str:
    """The one supported entry of `architectures`.

    Raises:
        ConfigError: none of ARCHITECTURES is named.
    """
    names = config.get("architectures") or []
    found = [name for name in names if name in ARCHITECTURES]
    if not found:
        raise ConfigError(
            f"config key {INIT_KEY}: {where} has architectures={names}; supported: "
            f"{', '.join(ARCHITECTURES)}"
        )
    return found[0]


def hf_shape_fields(directory: str | Path) -> dict[str, Any]:
    """The ModelShape fields a checkpoint's config.json fixes, by shape name.

    Returns:
        vocab_size, dim, n_layers, n_heads, n_kv_heads, ffn_dim, rope_theta,
        norm_eps and qkv_bias.

    Raises:
        ConfigError: missing file, unsupported architecture or a feature the
            LLaMA-style block does not compute; the message names the key and path.
    """
    config = read_hf_config(directory)
    where = str(Path(directory) / CONFIG_FILE)
    arch = architecture(config, where)
    _refuse_unsupported(config, arch, where)
    fields: dict[str, Any] = {}
    for name, key in SHAPE_KEYS.items():
        value = rope_theta(config) if key == "rope_theta" else config.get(key)
        if key == "num_key_value_heads" and value is None:
            value = config.get("num_attention_heads")
        if value is None:
            raise ConfigError(f"config key {INIT_KEY}: {where} lacks {key!r}")
        fields[name] = float(value) if name in ("rope_theta", "norm_eps") else int(value)
    fields["qkv_bias"] = arch == "Qwen2ForCausalLM"
    return fields


def rope_theta(config: dict[str, Any]) -> float:
    """RoPE base: top-level `rope_theta` (transformers 4) or `rope_parameters` (5)."""
    params = config.get("rope_parameters") or {}
    return float(config.get("rope_theta", params.get("rope_theta", 10000.0)))


def tied(config: dict[str, Any]) -> bool:
    """Whether the checkpoint shares its input embedding with the output projection."""
    return bool(config.get("tie_word_embeddings", False))


def _refuse_unsupported(config: dict[str, Any], arch: str, where: str) -> None:
    def refuse(key: str, why: str) -> None:
        raise ConfigError(f"config key {INIT_KEY}: {where} has {key}={config.get(key)!r}; {why}")

    if config.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "only SiLU (SwiGLU) feed-forwards are supported")
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    head_dim = config.get("head_dim")
    if head_dim is not None and heads and hidden and head_dim * heads != hidden:
        refuse("head_dim", "the head dimension must be hidden_size / num_attention_heads")
    for key in ("rope_scaling", "rope_parameters"):
        kind = (config.get(key) or {}).get("rope_type", (config.get(key) or {}).get("type"))
        if kind not in (None, "default"):
            refuse(key, "RoPE scaling is not supported (plain RoPE only)")
    if config.get("mlp_bias"):
        refuse("mlp_bias", "feed-forward biases are not supported")
    if arch == "LlamaForCausalLM" and config.get("attention_bias"):
        refuse("attention_bias", "Llama's attention biases (o_proj included) are not supported")
    if arch == "Qwen2ForCausalLM" and config.get("use_sliding_window"):
        refuse("use_sliding_window", "sliding-window attention is not supported")
